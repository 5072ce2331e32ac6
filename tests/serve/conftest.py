"""Fixtures for `kvtrace serve`: real servers on loopback sockets, real stores, a tiny real model.

- `serve_local`: `kvtrace serve` in local mode (a tiny random Llama with the
  default model's tokenizer, a fresh KV cache) on a loopback port;
- `serve_upstream`: `kvtrace serve --upstream URL` on a loopback port (the
  `canned_upstream` of tests/conftest.py, or another server, behind it);
- `canned_apis`: an upstream speaking Anthropic Messages and OpenAI Responses
  (tests/serve/canned_proxied.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

SERVER_KEY = "kv-server-key-XYZ987"


@pytest.fixture(scope="session")
def tiny_model_folder(tiny_model_factory) -> Path:
    """A tiny random Llama with the default model's tokenizer and chat template."""
    return tiny_model_factory("tracer-model", seed=5)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_folder, tmp_path_factory) -> Any:
    from kvtrace.engine import load_engine

    return load_engine(tiny_model_folder, cache_dir=tmp_path_factory.mktemp("tracer-cache"))


@pytest.fixture
def serve_started() -> Iterator[Callable[..., Any]]:
    """`start(**make_server_options)`: a started server; `.url`, `.server`; stopped at the end."""
    from kvtrace.serve import BackgroundServer, make_server

    started: list[BackgroundServer] = []

    def start(**options: Any) -> Any:
        server = make_server(**options)
        running = BackgroundServer(server.app).start()
        running.server = server  # type: ignore[attr-defined]
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def serve_local(serve_started, tiny_engine, tmp_path) -> Callable[..., Any]:
    """`serve_local(store, **options)`: a started local-mode server; `.url`, `.server`."""
    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend

    def make(store: Any, **options: Any) -> Any:
        backend = LocalBackend(tiny_engine, KVCache(tiny_engine, disk_dir=tmp_path / "kv"))
        return serve_started(backend=backend, store=store, **options)

    return make


@pytest.fixture
def serve_upstream(serve_started) -> Callable[..., Any]:
    """`serve_upstream(store, upstream_url, **options)`: a started upstream-mode server."""

    def make(store: Any, upstream: str, **options: Any) -> Any:
        return serve_started(upstream=upstream, store=store, **options)

    return make


@pytest.fixture
def canned_apis() -> Iterator[Any]:
    """tests/serve/canned_proxied.py's Anthropic and Responses upstream, on a free loopback port."""
    from tests.serve.canned_proxied import CannedApis

    server = CannedApis().start()
    yield server
    server.stop()


def recorded_steps(store, run: str) -> list:
    """The steps of `run`, [] while it does not exist yet (a waiting test polls this, not
    the run's name: PostgreSQL may show the name before the step)."""
    from kvtrace.errors import KvtraceError

    try:
        return store.path(run)
    except KvtraceError:
        return []
