"""The Git-like, append-only trace store (see store.py for the design)."""

from __future__ import annotations

from pathlib import Path

from kvtrace.errors import StoreNotFoundError
from kvtrace.store.backend import create_db_engine, current_revision, migrate, safe_url
from kvtrace.store.names import validate_run_name
from kvtrace.store.records import (
    Divergence,
    FsckReport,
    GraphRow,
    Note,
    ReflogEntry,
    RunInfo,
    Step,
)
from kvtrace.store.run import Run
from kvtrace.store.store import Store

__all__ = [
    "Divergence",
    "FsckReport",
    "GraphRow",
    "Note",
    "ReflogEntry",
    "Run",
    "RunInfo",
    "Step",
    "Store",
    "default_url",
    "open_store",
    "validate_run_name",
]


def default_url() -> str:
    """The embedded SQLite store: `$KVTRACE_HOME/store.db` or `./.kvtrace/store.db`."""
    from kvtrace.paths import default_home

    return f"sqlite:///{default_home() / 'store.db'}"


def open_store(url: str | None = None, *, create: bool = True) -> Store:
    """Open the store at a SQLAlchemy URL, migrating its schema as needed.

    `None` means the embedded default. Plain ``postgresql://`` URLs use psycopg 3.
    With `create=False` a missing store is an error instead of being created,
    so that a read in the wrong folder changes nothing.
    """
    url = url or default_url()
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        path = Path(url[len("sqlite:///") :])
        if not create and not path.is_file():
            raise StoreNotFoundError(f"no kvtrace store at {path}: run `kvtrace init` first")
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_db_engine(url)
    if not create and current_revision(engine) is None:
        engine.dispose()
        raise StoreNotFoundError(f"no kvtrace store at {safe_url(url)}: run `kvtrace init` first")
    migrate(engine)
    return Store(engine, url)
