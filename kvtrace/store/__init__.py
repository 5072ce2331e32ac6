"""The Git-like, append-only trace store (see store.py for the design).

Its modules, by job (the provider APIs' shapes live below it, in kvtrace/apis):

- the public surface, here: `store.py` (the facade), `run.py`, `records.py`,
  `kinds.py` (typed step views), `usage.py`, `names.py`, `watch.py`,
  `notes.py`, `edits.py`, `bundle.py` (export and import of a run),
  `validation.py` (what enters), `recent.py`;
- `objects/`: the object store beneath the facade (the canonical encoding,
  bodies, deltas, lists, the step writer, history, refs, fsck);
- `db/`: the database (engines, tables, migrations);
- `present/`: presentation (one line per step, what differs between runs).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa

from kvtrace.errors import StoreNotFoundError, UsageError
from kvtrace.store.db.backend import create_db_engine, current_revision, migrate, safe_url
from kvtrace.store.kinds import (
    HttpExchange,
    ModelCall,
    NoteStep,
    ProviderApi,
    StepKind,
    ToolCall,
    VerdictStep,
    view,
)
from kvtrace.store.names import validate_run_name
from kvtrace.store.records import (
    Divergence,
    FsckReport,
    GraphRow,
    Growth,
    Note,
    ReflogEntry,
    RunInfo,
    Step,
)
from kvtrace.store.run import Run
from kvtrace.store.store import OnStep, Store
from kvtrace.store.usage import Usage

T = TypeVar("T")  # what an import returns (the run, or the runs, it made)

__all__ = [
    "Divergence",
    "FsckReport",
    "GraphRow",
    "Growth",
    "HttpExchange",
    "ModelCall",
    "Note",
    "NoteStep",
    "OnStep",
    "ProviderApi",
    "ReflogEntry",
    "Run",
    "RunInfo",
    "Step",
    "StepKind",
    "Store",
    "ToolCall",
    "Usage",
    "VerdictStep",
    "default_url",
    "import_into",
    "init_store",
    "open_store",
    "validate_run_name",
    "view",
]


def default_url() -> str:
    """The embedded SQLite store: `$KVTRACE_HOME/store.db` or `./.kvtrace/store.db`."""
    from kvtrace.paths import default_home

    return f"sqlite:///{default_home() / 'store.db'}"


def open_store(url: str | None = None, *, create: bool = True) -> Store:
    """Open the store at a SQLAlchemy URL, migrating its schema as needed.

    `None` means the embedded default. Plain ``postgresql://`` URLs use psycopg 3.
    With `create=False` a missing store is an error instead of being created,
    so that a read in the wrong folder changes nothing. A new SQLite store is
    private: the file is made 0600 (SQLite gives its -wal and -shm files the
    same mode) and a folder made for it 0700, as Git does not but SSH does:
    it holds every prompt and tool result (docs/store.md).
    """
    url = _full_url(url)
    if url.startswith("sqlite:///") and _sqlite_path(url) != ":memory:":
        path = Path(_sqlite_path(url))
        if not create and not path.is_file():
            raise StoreNotFoundError(f"no kvtrace store at {path}: run `kvtrace init` first")
        _create_private_file(path)
    engine = create_db_engine(url)
    if not create and current_revision(engine) is None:
        engine.dispose()
        raise StoreNotFoundError(f"no kvtrace store at {safe_url(url)}: run `kvtrace init` first")
    migrate(engine)
    return Store(engine, url)


def init_store(url: str | None = None, *, force: bool = False) -> Store:
    """Create the store at `url` (or open it if it exists): what `kvtrace init` does.

    A database that holds other tables but no kvtrace store is refused unless
    `force`: kvtrace's tables would land beside someone else's data.
    """
    url = _full_url(url)
    is_new_file = url.startswith("sqlite:///") and not Path(_sqlite_path(url)).is_file()
    if not force and not is_new_file:
        engine = create_db_engine(url)
        try:
            if current_revision(engine) is None:
                others = sorted(sa.inspect(engine).get_table_names())
                if others:
                    raise UsageError(
                        f"{safe_url(url)} holds other tables ({', '.join(others[:5])}) and no "
                        "kvtrace store: pass force=True to add kvtrace's tables beside them",
                        param="force",
                    )
        finally:
            engine.dispose()
    return open_store(url)


def import_into(url: str | None, load: Callable[[Store], T]) -> T:
    """Run an import `load(store)` on the store at `url`, creating the store only if it succeeds.

    When no store exists yet, the import first runs on a scratch store in a
    temporary folder, which makes every check; a refused file leaves nothing
    behind. `load` must be repeatable (read its input from bytes it holds).
    """
    import tempfile

    try:
        store = open_store(url, create=False)
    except StoreNotFoundError:
        with tempfile.TemporaryDirectory(prefix="kvtrace-import-") as folder, open_store(
            f"sqlite:///{Path(folder) / 'scratch.db'}"
        ) as scratch:
            load(scratch)
        store = open_store(url)
    with store:
        return load(store)


def _create_private_file(path: Path) -> None:
    """Make `path` an empty 0600 file in a folder made 0700 (existing ones are left alone)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _full_url(url: str | None) -> str:
    url = url or default_url()
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def _sqlite_path(url: str) -> str:
    return url[len("sqlite:///") :].partition("?")[0]
