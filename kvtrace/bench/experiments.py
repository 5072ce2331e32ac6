"""K experiments from one fork point at once, against the same K one after another.

Two ways to run K experiments, each measured both ways on the local engine:

- `agents`: `kvtrace record --from base@K --n N`: N processes of the fork
  agent (fork_agent.py, sampled, no seed sent: agent i gets seed i - 1 from
  the server) against one server, answered from the recording up to step K,
  live after; against the same N agents run one after another through the
  same kind of server;
- `branch`: `kvtrace branch branch-base --n N` (`branch_out`, N
  continuations of up to `steps` calls, seeds 0..N-1, decoded together) of a
  demo ReAct agent's run (whose tools kvtrace runs: a question asking for a
  long answer over the same ~2,000-token rules, an action, its result),
  against the same N branches run one at a time (`branch_out(n=1, seed=i)`).

Two figures per side, each completion tokens generated live, summed, per
second: of wall time (`tok_per_s`: the agents' process starts, their
replayed calls, every prefill and output insert included), and of decoding
(`decode_tok_per_s`: the engine thread's seconds choosing tokens and in
decode forwards, `DecodeBatcher.decode_seconds`, as the engine's own batch
benchmark counts it); `ratio` and `decode_ratio` compare the best of each
side. Each
side starts from a fresh KV cache with the fork point's prefix warmed
(not timed), so neither reuses what the other computed; the sides alternate
(`trials`). Both sides run every request through a `DecodeBatcher`, so each
agent's and each branch's tokens are the same on both sides: checked, and
the check is in the figures (`same_tokens`).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtrace.bench.fork_agent import SYSTEM, run_agent
from kvtrace.serve import BackgroundServer, make_server
from kvtrace.store import ModelCall, StepKind, Store, open_store

CASES = ("agents", "branch")
BRANCH_BASE = "branch-base"
BRANCH_QUESTION = ("What is 12 times 7? Then write ten notes about the sea, one per line, "
                   "each naming a place and a time of day.")


def run_experiments_bench(*, model: str | None = None, n: int = 8, calls: int = 10,
                          k: int = 8, max_tokens: int = 96, temperature: float = 0.8,
                          steps: int = 2, trials: int = 1,
                          cases: tuple[str, ...] = CASES) -> dict[str, Any]:
    """N agents and N branches from one fork point, together against one after another
    (`cases`: either or both)."""
    from kvtrace.engine import load_engine, open_cache
    from kvtrace.replay.local import LocalBackend

    if not 1 <= k < calls:
        raise ValueError(f"k must be in 1..{calls - 1}")
    if not cases or set(cases) - set(CASES):
        raise ValueError(f"cases must be some of {CASES}")
    engine = load_engine(model)
    figures: dict[str, Any] = {"model": engine.name, "n": n, "calls": calls, "k": k,
                               "max_tokens": max_tokens, "temperature": temperature,
                               "branch_steps": steps, "trials": trials}

    def fresh() -> LocalBackend:
        return LocalBackend(engine, open_cache(engine)).batching()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = open_store(f"sqlite:///{root / 'bench.db'}")
        if "agents" in cases:
            server = make_server(backend=LocalBackend(engine, open_cache(engine)), store=store,
                                 run="base")
            (root / "base").mkdir()
            with BackgroundServer(server.app) as running:
                run_agent(running.url, root / "base", calls=calls, model=engine.name,
                          max_tokens=max_tokens, temperature=temperature)
            command = [sys.executable, "-m", "kvtrace.bench.fork_agent", "--calls",
                       str(calls), "--max-tokens", str(max_tokens), "--temperature",
                       str(temperature), "--model", engine.name]
            spec = f"base@{k}"
            figures["agents"] = _alternate(trials, lambda together, trial: _agents_side(
                store, fresh(), spec, command, n, root / f"{together}-{trial}", together))
        if "branch" in cases:
            _record_branch_base(store, engine.name)
            figures["branch"] = _alternate(trials, lambda together, trial: _branch_side(
                store, fresh(), BRANCH_BASE, n, steps, max_tokens, temperature,
                f"{together}-{trial}", together))
        store.close()
    return figures


def _alternate(trials: int, side: Any) -> dict[str, Any]:
    """Both sides `trials` times, taking turns; tok/s and their ratio, best of each."""
    rows: dict[str, list[dict[str, Any]]] = {"one_after_another": [], "together": []}
    for trial in range(trials):
        order = ("together", "one_after_another") if trial % 2 else (
            "one_after_another", "together")
        for name in order:
            rows[name].append(side(name, trial))
    same = all(a["outputs"] == b["outputs"] for a, b in zip(
        rows["one_after_another"], rows["together"], strict=True))
    for name in rows:
        for row in rows[name]:
            row.pop("outputs")

    def ratio(key: str) -> float | None:
        best = {name: max(row[key] for row in rows[name]) for name in rows}
        alone = best["one_after_another"]
        return round(best["together"] / alone, 2) if alone else None

    return {**{name: rows[name] for name in rows}, "ratio": ratio("tok_per_s"),
            "decode_ratio": ratio("decode_tok_per_s"), "same_tokens": same,
            "target_ratio": 3.0}


def _agents_side(store: Store, backend: Any, spec: str, command: list[str], n: int,
                 folder: Path, side: str) -> dict[str, Any]:
    from kvtrace.serve.agents import make_agents
    from kvtrace.serve.experiment import run_agents
    from kvtrace.serve.fromrun import warm

    warm(store, spec, backend)
    agents = make_agents(store, side, n, workdir=str(folder / "{i}"))
    server = make_server(backend=backend, store=store, from_run=spec, agents=agents,
                         max_queue=2 * n)
    with BackgroundServer(server.app) as running:
        started = time.perf_counter()
        if side == "together":
            exits = run_agents(command, agents, running.url)
        else:
            exits = [ended for agent in agents
                     for ended in run_agents(command, [agent], running.url)]
        seconds = time.perf_counter() - started
    backend.close()
    if any(ended.exit_code for ended in exits):
        raise RuntimeError(f"an agent failed: exit codes {[e.exit_code for e in exits]}")
    outputs = [_live_outputs(store, agent.fork) for agent in agents]
    batch = server.answerer.health().get("batch") or {}
    return _row(seconds, outputs, max_rows=batch.get("max_rows"),
                decode_s=batch.get("decode_s") or 0.0)


def _record_branch_base(store: Store, model: str) -> None:
    """A demo ReAct agent's run (kvtrace runs its tools) over the fork agent's ~2,000-token
    rules: a question asking for a long answer, the model's action, the tool's result; what
    `kvtrace branch` continues (a recorded final answer would leave it nothing to do)."""
    from kvtrace.replay.tools import demo_messages

    run = store.run(BRANCH_BASE)
    run.record_model_call(demo_messages(BRANCH_QUESTION, notes=SYSTEM),
                          "Thought: I need the product first.\nAction: calculator\n"
                          "Action Input: 12*7", model=model)
    run.record_tool_call("calculator", "12*7", 84)


def _branch_side(store: Store, backend: Any, spec: str, n: int, steps: int, max_tokens: int,
                 temperature: float, prefix: str, side: str) -> dict[str, Any]:
    from kvtrace.replay import SamplingParams, checkout
    from kvtrace.replay.branch import branch_out
    from kvtrace.replay.tools import DEMO_TOOLS

    tools = DEMO_TOOLS

    params = SamplingParams(temperature=temperature, max_new_tokens=max_tokens)
    checkout(store, spec, backend)  # the prefix warm on both sides (not timed)
    started = time.perf_counter()
    if side == "together":
        reports = [branch_out(store, spec, backend, n=n, steps=steps, tools=tools,
                              params=params, seed=0, prefix=prefix)]
    else:
        reports = [branch_out(store, spec, backend, n=1, steps=steps, tools=tools,
                              params=params, seed=index, prefix=f"{prefix}-{index}")
                   for index in range(n)]
    seconds = time.perf_counter() - started
    max_rows, decode_s = backend.batcher.max_step_rows, backend.batcher.decode_seconds
    backend.close()
    outputs = [[ModelCall(s).output_ids for s in branch.result.new_steps
                if s.kind == StepKind.MODEL_CALL]
               for report in reports for branch in report.branches]
    return _row(seconds, outputs, max_rows=max_rows, decode_s=decode_s)


def _live_outputs(store: Store, run: str) -> list[list[int] | None]:
    """The output token ids of the model calls recorded live on `run` (not base's)."""
    recorded = {step.id for step in store.path("base")}
    return [ModelCall(s).output_ids for s in store.path(run)
            if s.kind == StepKind.MODEL_CALL and s.id not in recorded]


def _row(seconds: float, outputs: list[list[list[int] | None]], *, max_rows: int | None,
         decode_s: float) -> dict[str, Any]:
    tokens = sum(len(ids or []) for run in outputs for ids in run)
    return {"seconds": round(seconds, 2), "completion_tokens": tokens,
            "tok_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            "decode_s": round(decode_s, 2),
            "decode_tok_per_s": round(tokens / decode_s, 2) if decode_s else 0.0,
            "max_rows": max_rows, "outputs": outputs}
