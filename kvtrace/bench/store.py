"""Store benchmark: append latency against its physical anchor, fork/revert cost
at 10 and 10,000 steps, and the bytes a store takes.

On SQLite, appends are timed in rounds of `_ROUND` alternating with the
anchor (anchor.py): the same rows written with plain `sqlite3`, so the ratio
of the two medians compares like with like under the same machine noise.
Fork and revert must not depend on the length of the run: fork adds one ref
row, and finding `RUN@2` from the head of a 10,000-step run (or checking that
revert's target is an ancestor) follows skip pointers inside one query. Both
are timed on a 10-step and a 10,000-step run in the same process,
alternating, so machine noise hits both sides alike; the medians and their
ratio are reported. `store_bytes_over_distinct` counts blob and body bytes of
a recorded conversation; `file_bytes_over_distinct` (footprint.py) what the
disk holds after an import of realistic trajectories.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtrace.apis import ProviderApi
from kvtrace.bench.anchor import SqliteAnchor
from kvtrace.bench.footprint import body_bytes, run_footprint_bench
from kvtrace.errors import UsageError
from kvtrace.store import Store, open_store

APPEND_TARGET_MS = 0.35  # SQLite append p50
ANCHOR_RATIO_TARGET = 3.0  # SQLite append p50 over the anchor's
FILE_BYTES_TARGET = 1.5  # file bytes over distinct content bytes, ≥ 1 MB imported
_ROUND = 50  # appends per turn of the store and of the anchor


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
    if num_appends < 1 or num_trials < 1:
        raise UsageError("the store benchmark needs at least 1 append and 1 trial")
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(url or f"sqlite:///{Path(tmp) / 'bench.db'}")
        try:
            return _measure(store, num_appends, num_trials)
        finally:
            store.close()


def _measure(store: Store, num_appends: int, num_trials: int) -> dict[str, Any]:
    suffix = f"{time.time_ns()}"  # runs of earlier benchmarks on a shared database stay apart
    append_ms, anchor_ms = _time_appends(store, f"bench-append-{suffix}", num_appends)

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
        # The same rows with plain sqlite3 (None on PostgreSQL).
        "anchor_append_ms_p50": round(p50(anchor_ms), 4) if anchor_ms else None,
        "append_over_anchor": round(p50(append_ms) / p50(anchor_ms), 3) if anchor_ms else None,
        "fork_ms_at_10": round(p50(fork_ms[10]), 4),
        "fork_ms_at_10000": round(p50(fork_ms[10_000]), 4),
        "fork_head_ms_at_10": round(p50(fork_head_ms[10]), 4),
        "fork_head_ms_at_10000": round(p50(fork_head_ms[10_000]), 4),
        "revert_ms_at_10": round(p50(revert_ms[10]), 4),
        "revert_ms_at_10000": round(p50(revert_ms[10_000]), 4),
    }
    result["fork_ratio"] = round(result["fork_ms_at_10000"] / result["fork_ms_at_10"], 3)
    result["revert_ratio"] = round(result["revert_ms_at_10000"] / result["revert_ms_at_10"], 3)
    # The append targets (p50 <= 0.35 ms, <= 3x the anchor) are set for the
    # embedded SQLite store; on PostgreSQL each commit waits for a WAL flush,
    # so only the ratios apply.
    is_sqlite = result["backend"] == "sqlite"
    conversation = run_conversation_bench(store.url, with_tool_steps=False)
    with_tools = run_conversation_bench(store.url, with_tool_steps=True, seed=1)
    result["store_bytes_over_distinct"] = conversation["store_bytes_over_distinct"]
    result["store_bytes_over_distinct_with_tool_steps"] = with_tools["store_bytes_over_distinct"]
    result["conversation"] = conversation
    # A seed of their own: on the same store, seed 0's openai-chat messages are stored
    # already, and a run that adds nothing would report 0.0.
    by_api = {api.value: run_conversation_bench(store.url, with_tool_steps=False, api=api,
                                                seed=2)
              for api in ProviderApi}
    result["store_bytes_over_distinct_by_api"] = {
        name: figures["store_bytes_over_distinct"] for name, figures in by_api.items()}
    # What the disk holds (SQLite: a new file; PostgreSQL: the growth of kvtrace's tables).
    footprint = run_footprint_bench(None if is_sqlite else store.url)
    result["file_bytes_over_distinct"] = footprint["file_bytes_over_distinct"]
    result["read_step_ms_p50"] = footprint["read_step_ms_p50"]
    result["footprint"] = footprint
    result["targets_met"] = (
        (not is_sqlite or (result["append_ms_p50"] <= APPEND_TARGET_MS
                           and result["append_over_anchor"] <= ANCHOR_RATIO_TARGET))
        and result["fork_ratio"] <= 1.2
        and result["revert_ratio"] <= 1.2
        and result["store_bytes_over_distinct"] <= 1.5
        and all(r <= 1.5 for r in result["store_bytes_over_distinct_by_api"].values())
        and result["file_bytes_over_distinct"] <= FILE_BYTES_TARGET
    )
    return result


def _time_appends(store: Store, name: str, num_appends: int) -> tuple[list[float], list[float]]:
    """ms per append of `num_appends` tool calls, and on SQLite ms per append of the
    anchor writing the same rows, in alternating rounds (both after 50 warm-up appends)."""
    run = store.run(name)
    folder = tempfile.TemporaryDirectory(prefix="kvtrace-anchor-")
    anchor = None
    if store.engine.dialect.name == "sqlite":
        with store.engine.connect() as conn:
            synchronous = int(conn.exec_driver_sql("PRAGMA synchronous").scalar_one())
        anchor = SqliteAnchor(Path(str(store.engine.url.database)),
                              Path(folder.name) / "anchor.db", name, synchronous=synchronous)
    append_ms: list[float] = []
    anchor_ms: list[float] = []
    try:
        warm = [run.record_tool_call("warm", {"i": i}, i).id for i in range(50)]
        if anchor is not None:  # connections, statement caches
            anchor.append(warm)
        for start in range(0, num_appends, _ROUND):
            ids = []
            for i in range(start, min(start + _ROUND, num_appends)):
                begin = time.perf_counter()
                ids.append(run.record_tool_call("bench", {"i": i}, i).id)
                append_ms.append((time.perf_counter() - begin) * 1000)
            if anchor is not None:
                anchor_ms.extend(anchor.append(ids))
    finally:
        if anchor is not None:
            anchor.close()
        folder.cleanup()
    return append_ms, anchor_ms


def run_conversation_bench(
    url: str | None = None, *, num_calls: int = 60, with_tool_steps: bool = True, seed: int = 0,
    api: ProviderApi = ProviderApi.OPENAI_CHAT,
) -> dict[str, Any]:
    """Bytes a `num_calls`-call tool-calling conversation takes in the store.

    The conversation (kvtrace/bench/conversations.py) is recorded as its model calls,
    as the tracer and the server record it; `with_tool_steps` also records a
    tool_call step per tool result, as an import does (each result is then
    stored twice: as the step's result and inside the next prompt's `tool`
    message). `store_bytes` counts the bytes of every blob and step body the
    run adds (measured as the growth of those tables, so a shared database
    works too); the denominator is the canonical bytes of the conversation's
    distinct messages and its tool list, what an ideal store would keep.
    With `api`, the same conversation is spoken in another provider API
    (conversations.py `in_api`) and the denominator counts its own shape.
    """
    import json

    from kvtrace.bench.conversations import in_api, tool_calling_conversation

    calls = in_api(tool_calling_conversation(num_calls, seed=seed), api)  # new content
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(url or f"sqlite:///{Path(tmp) / 'bench.db'}")
        try:
            before = _stored_bytes(store)
            run = store.run(f"bench-conversation-{time.time_ns()}")
            model_call_ms = []
            for call in calls:
                model_call_ms.append(_time_ms(lambda c=call: run.record_model_call(
                    c.messages, c.response, model="bench", tools=c.tools, usage=c.usage,
                    api=api, system=c.system)))
                if with_tool_steps:
                    for call_id, name, arguments, result in call.results:
                        run.record_tool_call(name, arguments, result, call_id=call_id)
            stored = _stored_bytes(store) - before
        finally:
            store.close()
    distinct_bytes = _distinct_bytes(calls, api)
    return {
        "api": api.value,
        "num_calls": num_calls,
        "num_messages": len(calls[-1].messages) + 1,
        "with_tool_steps": with_tool_steps,
        "distinct_message_bytes": distinct_bytes,
        "record_model_call_ms_p50": round(statistics.median(model_call_ms), 4),
        "store_bytes": stored,
        "store_bytes_over_distinct": round(stored / distinct_bytes, 3),
        "one_blob_per_call_bytes": sum(
            len(json.dumps([*c.messages], separators=(",", ":"))) for c in calls),
    }


def _distinct_bytes(calls: list[Any], api: ProviderApi) -> int:
    """Canonical bytes of the distinct messages, responses, tool list and system prompt."""
    from kvtrace.apis import stored_fields
    from kvtrace.store.objects.encoding import canonical_json

    distinct: set[bytes] = set()
    for call in calls:
        payload, lists = stored_fields(api, call.messages, call.response, tools=call.tools,
                                       system=call.system)
        distinct.update(canonical_json(item) for items in lists.values() for item in items)
        distinct.update(canonical_json(value) for value in payload.values())
    return sum(len(d) for d in distinct)


def _stored_bytes(store: Store) -> int:
    """Bytes of every blob's content and step body (canonical, as hashed) in the store."""
    import sqlalchemy as sa

    with store.engine.connect() as conn:
        blob_bytes = conn.execute(sa.text("SELECT COALESCE(SUM(size), 0) FROM blobs")).scalar()
        canonical_body_bytes, _ = body_bytes(conn)
    return int(blob_bytes or 0) + canonical_body_bytes
def run_append_comparison(
    urls: list[str] | None = None, *, num_appends: int = 1000, round_size: int = 50
) -> dict[str, Any]:
    """Append latency on several stores side by side: like for like across durability settings.

    The stores take turns, `round_size` appends each, so machine noise hits all
    of them alike. Default: two fresh SQLite files in a temp folder, one with
    `synchronous=normal` (the default) and one with `synchronous=full`.
    """
    if num_appends < 1 or round_size < 1:
        raise UsageError("the append comparison needs at least 1 append per store")
    with tempfile.TemporaryDirectory() as tmp:
        urls = urls or [
            f"sqlite:///{Path(tmp) / 'normal.db'}",
            f"sqlite:///{Path(tmp) / 'full.db'}?synchronous=full",
        ]
        stores = [open_store(url) for url in urls]
        try:
            suffix = f"{time.time_ns()}"
            runs = [store.run(f"bench-durability-{suffix}") for store in stores]
            for run in runs:
                for i in range(20):  # warm up connections and statement caches
                    run.record_tool_call("warm", {"i": i}, i)
            times: list[list[float]] = [[] for _ in stores]
            done = 0
            while done < num_appends:
                count = min(round_size, num_appends - done)
                for run, samples in zip(runs, times, strict=True):
                    for i in range(done, done + count):
                        samples.append(
                            _time_ms(lambda i=i, r=run: r.record_tool_call("bench", {"i": i}, i))
                        )
                done += count
            return {
                "num_appends": num_appends,
                "stores": [
                    {
                        "url": store.display_url,
                        "append_ms_p50": round(statistics.median(samples), 4),
                        "append_ms_p95": round(sorted(samples)[int(0.95 * len(samples))], 4),
                        "append_per_s": round(1000 / statistics.mean(samples), 1),
                    }
                    for store, samples in zip(stores, times, strict=True)
                ],
            }
        finally:
            for store in stores:
                store.close()
