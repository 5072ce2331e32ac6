"""Fixtures for `kvtrace mcp`: the real server in its own process, reached with the SDK's client.

- `stores` (module scope, SQLite and PostgreSQL): a store URL, created empty;
- `client` (module scope): a `Client` on `python -m kvtrace --store URL mcp --model TINY`
  over stdio: the SDK's `ClientSession` over `stdio_client`, on an event loop of its
  own thread so that tests call it plainly (`client.call("fork", spec=..., new=...)`);
- `sqlite_client`: the same on SQLite only, for the tools that only read.

The server's model is a tiny random Llama (tests/conftest.py), its KV blocks
in a folder of the module's; the server's stderr is kept in a file and shown
when a test fails to start it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.types import CallToolResult

from kvtrace import open_store
from tests.conftest import PG_URL

ROOT = Path(__file__).resolve().parents[2]
Transport = Callable[[], AbstractAsyncContextManager[Any]]


class ToolFailed(Exception):
    """A tool answered with a tool error (isError); the message is its text."""


class Client:
    """An MCP `ClientSession`, opened, used and closed in one task of its own event loop."""

    def __init__(self, transport: Transport) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        ready: concurrent.futures.Future[ClientSession] = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._main = asyncio.run_coroutine_threadsafe(self._hold(transport, ready), self._loop)
        self.session = ready.result(timeout=120)

    async def _hold(self, transport: Transport,
                    ready: concurrent.futures.Future[ClientSession]) -> None:
        """Open the session, hand it over, and close it in this same task when told to."""
        try:
            async with transport() as streams, ClientSession(streams[0], streams[1]) as session:
                self.initialized = await session.initialize()
                self._stop = asyncio.Event()
                ready.set_result(session)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    def run(self, coroutine: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def result(self, tool: str, **arguments: Any) -> CallToolResult:
        """The tool's whole result, error or not."""
        return self.run(self.session.call_tool(tool, arguments))

    def call(self, tool: str, **arguments: Any) -> dict[str, Any]:
        """The tool's structured result; a tool error raises ToolFailed with its text."""
        result = self.result(tool, **arguments)
        if result.is_error:
            raise ToolFailed(result.content[0].text)
        return result.structured_content

    def fail(self, tool: str, **arguments: Any) -> str:
        """The text of the tool error the call must give."""
        result = self.result(tool, **arguments)
        assert result.is_error, f"{tool} succeeded: {result.structured_content}"
        assert len(result.content) == 1
        return result.content[0].text

    def read(self, uri: str) -> str:
        """The text of a resource."""
        result = self.run(self.session.read_resource(uri))
        assert len(result.contents) == 1 and result.contents[0].mime_type == "application/json"
        return result.contents[0].text

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        try:
            self._main.result(timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()


def server_env(cache: Path) -> dict[str, str]:
    """What `python -m kvtrace` needs beyond the SDK's safe defaults: this checkout, a cache."""
    return {"PYTHONPATH": str(ROOT), "KVTRACE_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}


def stdio(url: str, *, model: Path | None, folder: Path) -> Transport:
    """The SDK's stdio transport to `kvtrace mcp` on `url`, started as a user configures it."""
    args = ["-m", "kvtrace", "--store", url, "mcp"]
    if model is not None:
        args += ["--model", str(model)]
    parameters = StdioServerParameters(command=sys.executable, args=args, cwd=folder,
                                       env=server_env(folder / "cache"))

    @asynccontextmanager
    async def transport() -> AsyncIterator[Any]:
        with (folder / "server.log").open("a") as errlog:
            async with stdio_client(parameters, errlog=errlog) as streams:
                yield streams

    return transport


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> Path:
    """A tiny random Llama with the default model's tokenizer (the server's --model)."""
    return tiny_model_factory("mcp-model", seed=11)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stores(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[str]:
    """The URL of a new store, on each backend (PostgreSQL: a fresh schema)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('mcp-store') / 'store.db'}"
        open_store(url).close()
        yield url
        return
    if not request.getfixturevalue("pg_available"):
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}")
    admin = sa.create_engine(PG_URL)
    schema = f"kvt_{uuid.uuid4().hex[:12]}"
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    sep = "&" if "?" in PG_URL else "?"
    url = f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    open_store(url).close()
    yield url
    with admin.begin() as conn:
        conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


def _client(url: str, model: Path, folder: Path) -> Iterator[Client]:
    try:
        client = Client(stdio(url, model=model, folder=folder))
    except Exception:
        log = folder / "server.log"
        print(log.read_text() if log.exists() else "(no server log)", file=sys.stderr)
        raise
    yield client
    client.close()


@pytest.fixture(scope="module")
def client(stores: str, tiny_model: Path, tmp_path_factory) -> Iterator[Client]:
    """A client of `kvtrace mcp` on a store of each backend."""
    yield from _client(stores, tiny_model, tmp_path_factory.mktemp("mcp-server"))


@pytest.fixture(scope="module")
def sqlite_url(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('mcp-sqlite') / 'store.db'}"
    open_store(url).close()
    return url


@pytest.fixture(scope="module")
def sqlite_client(sqlite_url: str, tiny_model: Path, tmp_path_factory) -> Iterator[Client]:
    """A client of `kvtrace mcp` on a SQLite store (the tools that only read)."""
    yield from _client(sqlite_url, tiny_model, tmp_path_factory.mktemp("mcp-server"))


@pytest.fixture
def name() -> str:
    """A run name no other test of the module uses (the module shares one store)."""
    return f"run-{uuid.uuid4().hex[:8]}"


def state(url: str) -> list[Any]:
    """Every run's head, every reflog entry, every note: what a refused call must leave."""
    store = open_store(url, create=False)
    try:
        notes = {s.id: [n.to_dict() for n in store.notes(s.id)]
                 for info in store.runs() if info.head_id for s in store.log(info.name)}
        return [[info.to_dict() for info in store.runs()],
                [entry.to_dict() for entry in store.reflog()], notes]
    finally:
        store.close()


def cli(capsys, url: str, *argv: str) -> tuple[int, str, str]:
    """`kvtrace --store URL ARGV...` run in this process: exit code, stdout, stderr."""
    from kvtrace.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", url, *argv])
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def cli_error(capsys, url: str, *argv: str) -> str:
    """The one line the CLI prints for a refused command, without its `error: `."""
    code, out, err = cli(capsys, url, *argv)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    return err.removeprefix("error: ").rstrip("\n")


def unpaged(document: Any) -> Any:
    """A tool's JSON with every step's `paged` (what the CLI's documents lack) taken out."""
    if isinstance(document, dict):
        return {k: unpaged(v) for k, v in document.items()
                if not (k == "paged" and "content" in document)}
    if isinstance(document, list):
        return [unpaged(v) for v in document]
    return document
