"""Local mode decodes the requests in flight together; each gets the tokens it gets alone.

Real loopback HTTP, a real SQLite store, the tiny random model. The
requests are held behind one engine call until all of them wait in the
engine's queue, so they are decoded together for certain (no timing).
"""

from __future__ import annotations

import threading

import httpx

from kvtrace.engine import KVCache
from kvtrace.replay.local import LocalBackend
from kvtrace.store import ModelCall
from tests.held_engine import engine_held

SYSTEM = {"role": "system", "content": "You write one line about the sea. " * 6}


def _bodies(model: str) -> list[tuple[str, dict]]:
    """Greedy and seeded sampled requests of other prompts and lengths, in two APIs (the
    Messages API has no seed: greedy)."""
    bodies: list[tuple[str, dict]] = []
    for i in range(6):
        body: dict = {"model": model, "max_tokens": 5 + 3 * i, "messages": [
            SYSTEM, {"role": "user", "content": f"Line {i} about boats, please."}]}
        if i % 2:
            body.update(temperature=0.9, top_p=0.95, seed=40 + i)
        bodies.append(("/chat/completions", body))
    bodies.append(("/messages", {"model": "claude-x", "max_tokens": 9,
                                 "system": SYSTEM["content"], "messages": [
                                     {"role": "user", "content": "A line about gulls."}]}))
    return bodies


def _post(url: str, path: str, body: dict, run: str) -> httpx.Response:
    reply = httpx.post(url + path, json=body, headers={"X-Kvtrace-Run": run}, timeout=300)
    reply.raise_for_status()
    return reply


def _answer(store, run: str) -> tuple[list[int] | None, str]:
    [step] = store.path(run)
    call = ModelCall(step)
    return call.output_ids, str(call.response.get("content"))


def test_concurrent_requests_get_exactly_the_tokens_each_gets_alone(
        sqlite_store, serve_started, tiny_engine, tmp_path):
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine, disk_dir=tmp_path / "kv")).batching()
    server = serve_started(backend=backend, store=sqlite_store, run="default")
    bodies = _bodies(tiny_engine.name)
    for i, (path, body) in enumerate(bodies):  # one after another
        _post(server.url, path, body, f"alone-{i}")
    batcher = backend.batcher
    assert batcher is not None and batcher.max_step_rows == 1
    clients = [threading.Thread(target=_post, args=(server.url, path, body, f"together-{i}"))
               for i, (path, body) in enumerate(bodies)]
    with engine_held(batcher, until_waiting=len(bodies)):  # all queued for the engine
        for thread in clients:
            thread.start()
    for thread in clients:
        thread.join(timeout=300)
    assert batcher.max_step_rows == len(bodies)  # decoded together
    health = httpx.get(server.url.removesuffix("/v1") + "/health").json()
    assert health["batch"]["max_rows"] == len(bodies)
    for i in range(len(bodies)):
        ids, text = _answer(sqlite_store, f"together-{i}")
        assert ids and (ids, text) == _answer(sqlite_store, f"alone-{i}"), f"request {i}"
    assert sqlite_store.path("together-1")[0].meta["params"]["seed"] == 41
