"""Store benchmark: append latency, and fork/revert cost at 10 and 10,000 steps.

Fork and revert must not depend on the length of the run: fork adds one ref
row, and finding `RUN@2` from the head of a 10,000-step run (or checking that
revert's target is an ancestor) follows skip pointers inside one query. Both are timed on a 10-step
and a 10,000-step run in the same process, alternating, so machine noise hits
both sides alike; the medians and their ratio are reported.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtrace.store import Store, open_store


def _grow(store: Store, name: str, num_steps: int) -> None:
    run = store.run(name)
    for i in range(num_steps):
        run.record_tool_call("bench", {"i": i}, {"value": i * 7})


def _time_ms(action: Any) -> float:
    start = time.perf_counter()
    action()
    return (time.perf_counter() - start) * 1000


def run_store_bench(
    url: str | None = None, *, num_appends: int = 2000, num_trials: int = 200
) -> dict[str, Any]:
    """Measure the store at `url` (default: a fresh SQLite file in a temp folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(url or f"sqlite:///{Path(tmp) / 'bench.db'}")
        try:
            return _measure(store, num_appends, num_trials)
        finally:
            store.close()


def _measure(store: Store, num_appends: int, num_trials: int) -> dict[str, Any]:
    suffix = f"{time.time_ns()}"  # runs of earlier benchmarks on a shared database stay apart
    run = store.run(f"bench-append-{suffix}")
    for i in range(50):  # warm up connections and statement caches
        run.record_tool_call("warm", {"i": i}, i)
    append_ms = []
    for i in range(num_appends):
        append_ms.append(_time_ms(lambda i=i: run.record_tool_call("bench", {"i": i}, i)))

    sizes = {10: f"bench-10-{suffix}", 10_000: f"bench-10000-{suffix}"}
    for size, name in sizes.items():
        _grow(store, name, size)

    # Forks and reverts target step 2 (`RUN@2`): the farthest walk from the head,
    # so the worst case for run length; the `_head` figures fork at the head.
    fork_ms: dict[int, list[float]] = {size: [] for size in sizes}
    fork_head_ms: dict[int, list[float]] = {size: [] for size in sizes}
    revert_ms: dict[int, list[float]] = {size: [] for size in sizes}
    for trial in range(num_trials):
        for size, name in sizes.items():
            fork_ms[size].append(
                _time_ms(lambda n=name, t=trial: store.fork(f"{n}@2", f"{n}-f{t}"))
            )
            fork_head_ms[size].append(_time_ms(lambda n=name, t=trial: store.fork(n, f"{n}-h{t}")))
            head = store.resolve(name)
            revert_ms[size].append(_time_ms(lambda n=name: store.revert(n, to=f"{n}@2")))
            store.reset(name, to=head)

    p50 = statistics.median
    result: dict[str, Any] = {
        "backend": store.engine.dialect.name,
        "num_appends": num_appends,
        "append_ms_p50": round(p50(append_ms), 4),
        "append_ms_p95": round(sorted(append_ms)[int(0.95 * len(append_ms))], 4),
        "append_per_s": round(1000 / statistics.mean(append_ms), 1),
        "fork_ms_at_10": round(p50(fork_ms[10]), 4),
        "fork_ms_at_10000": round(p50(fork_ms[10_000]), 4),
        "fork_head_ms_at_10": round(p50(fork_head_ms[10]), 4),
        "fork_head_ms_at_10000": round(p50(fork_head_ms[10_000]), 4),
        "revert_ms_at_10": round(p50(revert_ms[10]), 4),
        "revert_ms_at_10000": round(p50(revert_ms[10_000]), 4),
    }
    result["fork_ratio"] = round(result["fork_ms_at_10000"] / result["fork_ms_at_10"], 3)
    result["revert_ratio"] = round(result["revert_ms_at_10000"] / result["revert_ms_at_10"], 3)
    # The append target (< 1 ms) is set for the embedded SQLite store; on
    # PostgreSQL each commit waits for a WAL flush, so only the ratios apply.
    is_sqlite = result["backend"] == "sqlite"
    result["targets_met"] = (
        (result["append_ms_p50"] < 1.0 or not is_sqlite)
        and result["fork_ratio"] <= 1.2
        and result["revert_ratio"] <= 1.2
    )
    return result


def run_conversation_bench(
    url: str | None = None, *, num_calls: int = 60, with_tool_steps: bool = True
) -> dict[str, Any]:
    """Bytes a `num_calls`-call tool-calling conversation takes in the store.

    `store_bytes` counts every blob and every step body; the denominator is
    the canonical bytes of the conversation's distinct messages (each
    message once, the tool list once), what an ideal store would keep.
    """
    import json

    import sqlalchemy as sa

    from kvtrace.bench.conversations import tool_calling_conversation
    from kvtrace.store.encoding import canonical_json
    from kvtrace.store.messages import normalize_message

    calls = tool_calling_conversation(num_calls)
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(url or f"sqlite:///{Path(tmp) / 'bench.db'}")
        try:
            run = store.run(f"bench-conversation-{time.time_ns()}")
            for call in calls:
                run.record_model_call(call.messages, call.response, model="bench",
                                      tools=call.tools, usage=call.usage)
                if with_tool_steps:
                    for call_id, name, arguments, result in call.results:
                        run.record_tool_call(name, arguments, result, call_id=call_id)
            with store.engine.connect() as conn:
                blob_bytes = conn.execute(sa.select(sa.func.sum(sa.column("size")))
                                          .select_from(sa.table("blobs"))).scalar() or 0
                body_bytes = sum(len(bytes(b)) for (b,) in conn.execute(
                    sa.text("SELECT body FROM steps")))
        finally:
            store.close()
    distinct = {canonical_json(normalize_message(m)) for c in calls
                for m in [*c.messages, c.response]}
    distinct_bytes = sum(len(d) for d in distinct) + len(canonical_json(calls[0].tools))
    return {
        "num_calls": num_calls,
        "num_messages": len(calls[-1].messages) + 1,
        "with_tool_steps": with_tool_steps,
        "distinct_message_bytes": distinct_bytes,
        "store_bytes": blob_bytes + body_bytes,
        "store_bytes_over_distinct": round((blob_bytes + body_bytes) / distinct_bytes, 3),
        "one_blob_per_call_bytes": sum(
            len(json.dumps([*c.messages], separators=(",", ":"))) for c in calls),
    }
