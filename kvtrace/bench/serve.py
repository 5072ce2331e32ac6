"""Server benchmark: latency and cache reuse through `kvtrace serve`, and what recording costs.

1. Local mode: `num_requests` sequential chat requests that extend one
   conversation (each sends the whole history plus a new user turn, as an
   agent does) through a real loopback socket to `kvtrace serve` on the
   model; reports p50/p95 latency as the client sees it and
   `cached_tokens_fraction` (cached / prompt tokens, from each answer's
   `usage.prompt_tokens_details.cached_tokens`).
2. Recording overhead: the same conversation's requests, `num_rounds` times
   (each round into a new run), through `--upstream` to a fast local upstream
   (a canned answer, no model), once with recording and once without,
   alternating request by request so machine noise hits both alike;
   `record_overhead_ms_p50` is the difference of the medians.

Every server and its store (a temporary SQLite file) is started here; the KV
cache is a fresh temporary folder, so the first request starts cold.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvtrace.serve import BackgroundServer, make_server
from kvtrace.store import open_store

_SYSTEM = ("You are a careful research assistant. Answer in one short sentence, and say "
           "when you are unsure. ") * 4
_CANNED = (b'{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"fast",'
           b'"choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant",'
           b'"content":"Noted."}}],"usage":{"prompt_tokens":100,"completion_tokens":2,'
           b'"total_tokens":102,"prompt_tokens_details":{"cached_tokens":96}}}')


def _question(i: int) -> str:
    return f"Step {i}: what should the agent check next about item {i * 7 % 13}?"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _fast_upstream() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def chat(request: Request) -> Response:
        await request.body()
        return Response(_CANNED, media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def _local_mode(model: str | None, cache_dir: Path, tmp: Path, num_requests: int,
                max_tokens: int) -> dict[str, Any]:
    from kvtrace.replay import open_local_backend

    backend = open_local_backend(model, cache_dir=cache_dir, kv_dir=tmp / "kv", batching=True)
    store = open_store(f"sqlite:///{tmp / 'local.db'}")
    server = make_server(backend=backend, store=store, run="bench-local")
    latencies, prompt, cached = [], 0, 0
    messages: list[dict[str, Any]] = [{"role": "system", "content": _SYSTEM}]
    with BackgroundServer(server.app) as running, httpx.Client(timeout=600) as client:
        for i in range(num_requests):
            messages.append({"role": "user", "content": _question(i)})
            started = time.perf_counter()
            reply = client.post(f"{running.url}/chat/completions", json={
                "model": backend.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0}).raise_for_status().json()
            latencies.append((time.perf_counter() - started) * 1000)
            messages.append(reply["choices"][0]["message"])
            prompt += reply["usage"]["prompt_tokens"]
            cached += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    store.close()
    backend.close()
    return {
        "model": backend.model,
        "requests": num_requests,
        "max_tokens": max_tokens,
        "p50_ms": round(statistics.median(latencies), 1),
        "p95_ms": round(_percentile(latencies, 0.95), 1),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_tokens_fraction": round(cached / prompt, 4) if prompt else None,
    }


def _record_overhead(tmp: Path, num_requests: int, num_rounds: int) -> dict[str, Any]:
    store = open_store(f"sqlite:///{tmp / 'overhead.db'}")
    times: dict[str, list[float]] = {"on": [], "off": []}
    with BackgroundServer(_fast_upstream()) as upstream:
        recording = make_server(upstream=upstream.url, store=store, run="bench-recorded")
        plain = make_server(upstream=upstream.url, run="bench-plain")  # no store: not recorded
        with BackgroundServer(recording.app) as on, BackgroundServer(plain.app) as off, \
                httpx.Client() as client:
            for round_number in range(num_rounds + 1):  # round 0 warms connections and caches
                headers = {"X-Kvtrace-Run": f"bench-recorded-{round_number}"}
                messages: list[dict[str, Any]] = [{"role": "system", "content": _SYSTEM}]
                for i in range(num_requests):
                    messages.append({"role": "user", "content": _question(i)})
                    body = {"model": "fast", "messages": messages, "max_tokens": 16}
                    for key, server in (("on", on), ("off", off))[:: 1 if i % 2 else -1]:
                        started = time.perf_counter()
                        client.post(f"{server.url}/chat/completions", json=body,
                                    headers=headers).raise_for_status()
                        if round_number:
                            times[key].append((time.perf_counter() - started) * 1000)
                    messages.append({"role": "assistant", "content": "Noted."})
    recorded_steps = sum(len(store.path(f"bench-recorded-{r}")) for r in range(num_rounds + 1))
    store.close()
    on_p50, off_p50 = statistics.median(times["on"]), statistics.median(times["off"])
    return {
        "overhead_requests": len(times["on"]),
        "upstream_p50_ms_recording": round(on_p50, 3),
        "upstream_p50_ms_not_recording": round(off_p50, 3),
        "record_overhead_ms_p50": round(on_p50 - off_p50, 3),
        "recorded_steps": recorded_steps,
    }


def run_serve_bench(*, cache_dir: Path, model: str | None = None, num_requests: int = 20,
                    max_tokens: int = 16, num_rounds: int = 10) -> dict[str, Any]:
    """Both measurements (see the module docstring), as one JSON-ready dict."""
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        result = _local_mode(model, cache_dir, tmp, num_requests, max_tokens)
        result.update(_record_overhead(tmp, num_requests, num_rounds))
    return result
