"""Many runs in flight: `replay_runs` at several concurrencies against one kind of server.

The runs are an evaluation set's: `num_runs` tool-calling conversations
(conversations.py, tau-bench-shaped, `num_calls` model calls each) that share
their system prompt and tools and differ in their task and tool results,
recorded once into a temporary store. Each case replays all of them with
`replay_runs(..., concurrency=C)` against a server started fresh for that
case (an empty prefix cache), so every case does the same work; the cases
take turns `trials` times, in alternating order, and the fastest of each
counts. `ratio` is the wall time at the highest concurrency over that at 1
(the target: <= 0.4 for 4 against a server with four parallel slots).

Servers (`server`):
- `serve`: `kvtrace serve` in its own process on the local model (one
  engine thread: prompts are prefilled one after another, the requests in
  flight decoded together, so verify gains from concurrency where rebuild,
  prompts only, gains the overlap of HTTP and tokenisation with the engine);
- `llama-cpp`: llama.cpp's server as llama-cpp-python ships it (the
  integration build's `.venv-llama`, or `llama_python`) on the same model's
  GGUF, on all cores. Its server (0.3.36) has no parallel slots: it takes
  one request at a time behind a lock (it has no `n_parallel` setting, and
  the wheel does not build llama.cpp's own `llama-server`), so it shows what
  a one-slot server gives. It refuses tool calls in messages, so its runs
  are the same conversations as plain text (`record_eval_set(as_text=True)`);
- `vllm`: vLLM's CPU build (`make bench-peers`) on the same model's folder,
  started once (its start compiles for a minute or more) and emptied before
  each case with its dev-mode cache reset (`replay_runs(reset_cache=True)`);
  its scheduler batches the requests in flight, prompts and decodes alike.
  The oracle is counted in its own tokens (its /tokenize);
- `slots`: a STAND-IN, not an engine: a loopback server that answers any chat
  request after a fixed `latency_ms`, at most `slots` at a time. It measures
  the client's side alone: how close `replay_runs` gets to the ideal of a
  server with that many truly parallel slots;
- any URL: a server already running (its cache is not reset between cases,
  so only the first case starts cold: alternate, and read the ratio warily).

The load average before and after is in the figures: on a shared 2-core
machine, compare ratios, not seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from kvtrace.bench.conversations import tool_calling_conversation
from kvtrace.bench.servers import kvtrace_serve, llama_cpp_server, vllm_server
from kvtrace.rendering import assistant_text
from kvtrace.replay import RemoteBackend, replay_runs
from kvtrace.replay.backend import Tokenizer
from kvtrace.replay.runs import RunsReport
from kvtrace.store import Store, open_store

SERVERS = ("serve", "llama-cpp", "vllm", "slots")
MODEL_NAME = "bench"


def record_eval_set(store: Store, *, num_runs: int, num_calls: int,
                    as_text: bool = False) -> list[str]:
    """`num_runs` runs that share the first run's system prompt and tools; their names.

    `as_text`: the same conversations in plain chat, for a server that refuses
    tool calls in messages (llama-cpp-python's answers HTTP 500, a validation
    error): no tool definitions, each tool call as the text the model wrote
    (rendering.py), each tool result as a user message.
    """
    names = []
    shared_system = tool_calling_conversation(1, seed=0)[0].messages[0]
    for index in range(num_runs):
        run = store.run(f"eval-{index:03d}")
        for call in tool_calling_conversation(num_calls, seed=index):
            messages = [shared_system, *call.messages[1:]]
            messages[1] = {**messages[1], "content": f"Task {index}: {messages[1]['content']}"}
            if as_text:
                run.record_model_call([_as_text(m) for m in messages],
                                      assistant_text(call.response), model=MODEL_NAME,
                                      usage=call.usage)
            else:
                run.record_model_call(messages, call.response, model=MODEL_NAME,
                                      tools=call.tools, usage=call.usage)
            for call_id, name, arguments, result in call.results:
                run.record_tool_call(name, arguments, result, call_id=call_id)
        names.append(run.name)
    return names


def run_multireplay_bench(
    *,
    cache_dir: Path,
    server: str = "serve",
    num_runs: int = 8,
    num_calls: int = 6,
    concurrency: tuple[int, ...] = (1, 4),
    mode: str = "rebuild",
    trials: int = 1,
    model: str | None = None,
    slots: int = 4,
    latency_ms: float = 200.0,
    llama_python: Path | None = None,
) -> dict[str, Any]:
    """Time `replay_runs` of the eval set at each concurrency (module docstring)."""
    if server not in SERVERS and not server.startswith(("http://", "https://")):
        raise ValueError(f"server must be one of {', '.join(SERVERS)} or a URL")
    tokenizer = None if server in ("slots", "vllm") else _tokenizer(model, cache_dir)
    load_before = os.getloadavg()
    walls: dict[int, list[float]] = {c: [] for c in concurrency}
    reports: dict[int, RunsReport] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        root = Path(tmp)
        store = open_store(f"sqlite:///{root / 'runs.db'}")
        names = record_eval_set(store, num_runs=num_runs, num_calls=num_calls,
                                as_text=server == "llama-cpp")
        started = None  # vLLM: one server for every case, reset before each
        if server == "vllm":
            started = stack.enter_context(vllm_server(root / "vllm", model=model,
                                                      cache_dir=cache_dir, alias=MODEL_NAME))
        for trial in range(trials):
            order = concurrency if trial % 2 == 0 else tuple(reversed(concurrency))
            for level in order:
                with _server(started or server, root / f"case-{trial}-{level}", model=model,
                             cache_dir=cache_dir, slots=slots, latency_ms=latency_ms,
                             llama_python=llama_python) as url, \
                        RemoteBackend(url, model=MODEL_NAME, tokenizer=tokenizer) as backend:
                    report = replay_runs(store, names, backend, concurrency=level, mode=mode,
                                         reset_cache=started is not None)
                walls[level].append(report.wall_s)
                if report.wall_s <= min(walls[level]):
                    reports[level] = report
        store.close()
    cases = {str(level): _case(walls[level], reports[level]) for level in concurrency}
    low, high = min(concurrency), max(concurrency)
    described = {"slots": f"slots (stand-in: {slots} at a time, {latency_ms:g} ms each, no "
                          "model)",
                 "llama-cpp": "llama-cpp (llama-cpp-python's server: one request at a time)",
                 "vllm": "vllm (vLLM's CPU build, its cache reset before each case)"}
    return {
        "server": described.get(server, server),
        "mode": mode,
        "runs": num_runs,
        "calls_per_run": num_calls,
        "trials": trials,
        "cases": cases,
        "ratio": round(min(walls[high]) / min(walls[low]), 3),
        "ratio_of": f"{high} over {low}",
        "target": "<= 0.4 (4 over 1, four parallel slots)",
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message without tool calls: what the model wrote, or a tool result as user text."""
    if message["role"] == "assistant":
        return {"role": "assistant", "content": assistant_text(message)}
    if message["role"] == "tool":
        return {"role": "user", "content": f"Observation: {message['content']}"}
    return message


def _case(walls: list[float], report: RunsReport) -> dict[str, Any]:
    total = report.total
    return {
        "wall_s": round(min(walls), 3),
        "wall_s_trials": [round(w, 3) for w in walls],
        "requests": total.steps,
        "requests_per_s": round(total.steps / min(walls), 3),
        "failed_runs": len(report.failed),
        "errors": sorted({f"{o.run}: {o.error}"[:300] for o in report.failed})[:3],
        "prompt_tokens": total.prompt_tokens,
        "hit_rate": None if total.hit_rate is None else round(total.hit_rate, 4),
        "oracle_hit_rate": None if total.oracle_hit_rate is None else
        round(total.oracle_hit_rate, 4),
        "reset": report.reset,
        "engine_counters": report.engine_counters,
    }


def _tokenizer(model: str | None, cache_dir: Path) -> Tokenizer:
    from kvtrace.engine import load_tokenizer

    return load_tokenizer(model, cache_dir=cache_dir)


@contextmanager
def _server(kind: str, folder: Path, *, model: str | None, cache_dir: Path, slots: int,
            latency_ms: float, llama_python: Path | None) -> Iterator[str]:
    """A fresh server of `kind` for one case; yields its base URL (…/v1)."""
    folder.mkdir(parents=True)
    if kind == "slots":
        from kvtrace.serve import BackgroundServer

        with BackgroundServer(_slots_app(slots, latency_ms / 1000)) as running:
            yield running.url
    elif kind.startswith(("http://", "https://")):
        yield kind
    elif kind == "serve":
        with kvtrace_serve(folder, model=model, cache_dir=cache_dir) as url:
            yield url
    else:
        with llama_cpp_server(folder, model=model, alias=MODEL_NAME,
                              llama_python=llama_python) as url:
            yield url


def _slots_app(slots: int, latency_s: float) -> Any:
    """The stand-in: any chat request answered "ok" after `latency_s`, `slots` at a time."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    gate: asyncio.Semaphore | None = None

    async def chat(request: Request) -> Response:
        nonlocal gate
        gate = gate or asyncio.Semaphore(slots)  # made on the server's own event loop
        body = await request.body()
        async with gate:
            await asyncio.sleep(latency_s)
        prompt_tokens = max(1, len(body) // 4)  # no tokenizer here: a size, not a count
        return Response(json.dumps({
            "id": "chatcmpl-slots", "object": "chat.completion", "model": MODEL_NAME,
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                      "total_tokens": prompt_tokens + 1}}), media_type="application/json")

    async def models(request: Request) -> Response:
        return Response(json.dumps({"object": "list", "data": [{"id": MODEL_NAME}]}),
                        media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models)])

