"""Shared fixtures: stores on real backends (a SQLite file, a PostgreSQL schema), and a canned
OpenAI-style upstream on a loopback socket (tests/canned.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.canned import CannedUpstream

PG_URL = os.environ.get("KVTRACE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _pg_available() -> bool:
    try:
        engine = sa.create_engine(PG_URL)
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
        engine.dispose()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def pg_available() -> bool:
    ok = _pg_available()
    if not ok and os.environ.get("CI"):
        pytest.fail(f"PostgreSQL is required under CI but {PG_URL} is unreachable")
    return ok


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> Callable[..., Path]:
    """`make(name, seed)`: a tiny random Llama folder with the default model's tokenizer.

    Two layers, 64 wide, four query heads sharing two KV heads; its chat
    template is the default model's, so prompts render as they do there.
    """
    from kvtrace.engine import build_tiny_model, default_model_dir
    from kvtrace.paths import default_cache_dir

    def make(name: str, seed: int) -> Path:
        root = tmp_path_factory.mktemp(name)
        return build_tiny_model(root / "tiny", tokenizer_dir=default_model_dir(default_cache_dir()),
                                seed=seed, num_layers=2, hidden_size=64, num_heads=4,
                                num_kv_heads=2, head_dim=16)

    return make


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module of tiny-model tests, then as it was.

    A tiny model computes fastest on one thread, and on a busy two-core
    machine two threads spin against each other: the doc tests' `kvtrace
    branch` measured 73 s with the default threads, 8 s with one.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_urls(request: pytest.FixtureRequest, tmp_path) -> Iterator[Callable[[], str]]:
    """A factory of URLs for new, empty stores on one backend (PostgreSQL: fresh schemas)."""
    if request.param == "sqlite":
        counter = iter(range(1_000_000))
        yield lambda: f"sqlite:///{tmp_path / f'store{next(counter)}.db'}"
        return
    if not request.getfixturevalue("pg_available"):
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}")
    admin = sa.create_engine(PG_URL)
    schemas: list[str] = []

    def make() -> str:
        schema = f"kvt_{uuid.uuid4().hex[:12]}"
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
        schemas.append(schema)
        sep = "&" if "?" in PG_URL else "?"
        return f"{PG_URL}{sep}options=-csearch_path%3D{schema}"

    yield make
    with admin.begin() as conn:
        for schema in schemas:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


@pytest.fixture
def store_url(store_urls: Callable[[], str]) -> str:
    """The URL of one empty store on each backend."""
    return store_urls()


@pytest.fixture
def store(store_url: str):
    from kvtrace import open_store

    s = open_store(store_url)
    yield s
    s.close()


@pytest.fixture
def sqlite_store(tmp_path) -> Iterator[Any]:
    """An empty SQLite store, for tests of the HTTP side.

    Tests of what is recorded and replayed (transports, serve in both modes)
    take `store`: one empty store on each backend.
    """
    from kvtrace import open_store

    store = open_store(f"sqlite:///{tmp_path / 'store.db'}")
    yield store
    store.close()


@pytest.fixture
def canned_upstream() -> Iterator[CannedUpstream]:
    """tests/canned.py's OpenAI-style server, started on a free loopback port."""
    server = CannedUpstream().start()
    yield server
    server.stop()


def tamper(store, sql: str, **params) -> None:
    """Run SQL that bypasses the append-only triggers, on purpose (tests of fsck)."""
    engine = store.engine
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text("SET LOCAL session_replication_role = replica"))
            conn.execute(sa.text(sql), params)
            return
        table = sql.split()[1] if sql.upper().startswith("UPDATE") else sql.split()[2]
        triggers = conn.execute(
            sa.text("SELECT name, sql FROM sqlite_master WHERE type='trigger' AND tbl_name=:t"),
            {"t": table},
        ).all()
        for name, _ in triggers:
            conn.execute(sa.text(f"DROP TRIGGER {name}"))
        conn.execute(sa.text(sql), params)
        for _, ddl in triggers:
            conn.execute(sa.text(ddl))
