"""What `--from RUN@K` saves: an unchanged agent forked at step K against re-running it all.

The agent is a ten-call chat agent whose tool writes a file (the loop of
examples/fork_agent.py, spoken here over httpx so the benchmark needs no
SDK) with a ~2,000-token system prompt (real agents' instructions and tool
documentation are longer), run against `kvtrace serve` on the local
engine over a loopback socket:

1. `base`: the agent recorded once (its KV blocks written to the disk tier).
2. `full_s`: the whole agent run again on a fresh KV cache: what re-running
   it costs without kvtrace.
3. `from_s`: `--from base@K`: the prefix warmed from the disk tier (`warm`),
   then the agent, the first K calls answered from the recording and the
   rest live on the warm prefix.

Cases 2 and 3 alternate `trials` times; the fastest of each counts.
`ratio = from_s / full_s`; the issue's target is <= 0.3 for K = 6 of 10.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvtrace.serve import BackgroundServer, make_server
from kvtrace.store import open_store

TOOLS = [{"type": "function", "function": {
    "name": "write_note", "description": "Append a line to notes.txt.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}}}]
# A coding agent's system prompt and tool documentation run to thousands of tokens; this
# one is ~2,000, the low end (the point: the prefix a fork does not recompute).
_SYSTEM = "You keep short notes about the sea: tides, weather, boats, birds.\n" + "".join(
    f"Rule {i}: a note about {topic} names one place and one time of day, in under twenty "
    "words, and never repeats an earlier note.\n"
    for i, topic in enumerate(["tides", "weather", "boats", "birds", "fish", "storms",
                               "harbours", "lighthouses"] * 10))


def run_agent(url: str, folder: Path, *, calls: int, model: str = "gpt-4o-mini",
              max_tokens: int = 24) -> int:
    """The ten-call agent against `url`; returns the completion tokens it was sent."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": "Write the first note about the sea."}]
    completion_tokens = 0
    with httpx.Client(base_url=url, timeout=600) as client:
        for turn in range(calls):
            reply = client.post("/chat/completions", json={
                "model": model, "messages": messages, "tools": TOOLS,
                "max_tokens": max_tokens, "temperature": 0})
            reply.raise_for_status()
            answer = reply.json()
            completion_tokens += answer.get("usage", {}).get("completion_tokens", 0)
            text = answer["choices"][0]["message"].get("content") or ""
            with (folder / "notes.txt").open("a", encoding="utf-8") as notes:
                notes.write(text.replace("\n", " ") + "\n")
            call_id = f"call_{turn}"
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": call_id, "type": "function", "function": {
                        "name": "write_note", "arguments": json.dumps({"text": text})}}]},
                {"role": "tool", "tool_call_id": call_id,
                 "content": json.dumps({"wrote_chars": len(text)})},
                {"role": "user", "content": f"Now note {turn + 2}, about something else."}]
    return completion_tokens


def record_agent(store: Any, backend: Any, folder: Path, name: str, *, calls: int,
                 **options: Any) -> tuple[float, Any]:
    """Run the agent against `kvtrace serve` on `backend`, recording run `name` (`options`:
    make_server's, e.g. `from_run`, `edit`); the seconds it took, and the server."""
    server = make_server(backend=backend, store=store, run=name, **options)
    folder.mkdir()
    with BackgroundServer(server.app) as running:
        started = time.perf_counter()
        run_agent(running.url, folder, calls=calls, model=backend.model)
        return time.perf_counter() - started, server


def run_fork_bench(*, model: str | None = None, calls: int = 10, k: int = 6,
                   trials: int = 2) -> dict[str, Any]:
    """Time re-running the agent against `--from base@K` (see the module docstring)."""
    from kvtrace.engine import KVCache, load_engine
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve.fromrun import warm

    if not 1 <= k < calls:
        raise ValueError(f"k must be in 1..{calls - 1}")
    engine = load_engine(model)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = open_store(f"sqlite:///{root / 'bench.db'}")
        disk = root / "kv"

        def serve_once(name: str, cache: KVCache, **options: Any) -> tuple[float, Any]:
            return record_agent(store, LocalBackend(engine, cache), root / name, name,
                                calls=calls, **options)

        serve_once("base", KVCache(engine, disk_dir=disk))
        full: list[float] = []
        forked: list[float] = []
        summary: dict[str, Any] = {}
        for trial in range(trials):
            seconds, _ = serve_once(f"rerun-{trial}", KVCache(engine))
            full.append(seconds)
            started = time.perf_counter()
            cache = KVCache(engine, disk_dir=disk)
            warmed = warm(store, f"base@{k}", LocalBackend(engine, cache))
            warm_s = time.perf_counter() - started
            seconds, server = serve_once(f"from-{trial}", cache, from_run=f"base@{k}")
            forked.append(warm_s + seconds)
            summary = {**server.answerer.summary.to_dict(), "warm_s": round(warm_s, 3),
                       "warmed_prompt_tokens": warmed}
        store.close()
    return {
        "model": engine.name, "calls": calls, "k": k, "trials": trials,
        "full_s": round(min(full), 3), "from_s": round(min(forked), 3),
        "full_s_trials": [round(s, 3) for s in full],
        "from_s_trials": [round(s, 3) for s in forked],
        "ratio": round(min(forked) / min(full), 3), "target_ratio": 0.3,
        "from": summary,
    }
