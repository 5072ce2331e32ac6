"""Where a soaked server's memory goes: RSS beside malloc's counts, Python's heap, the caches.

    .venv/bin/python scripts/soak.py --model tiny --seconds 600 --probe-memory OUT \
        [--tracemalloc 12]
    .venv/bin/python scripts/soak_memory.py OUT          # what grew, from the samples and snapshots

Why each figure: RSS alone cannot tell memory that is held (retained
objects, a cache filling) from memory that was freed but not given back to
the kernel (glibc keeps freed chunks in its arenas; a fragmented arena keeps
whole pages resident). So every `--probe-every` seconds the server process
writes one JSON line to OUT/samples.jsonl with:

- RSS, split into anonymous and file-backed pages (/proc/self/status);
- glibc's `mallinfo2`: bytes in use (`uordblks`), free but kept in the
  arenas (`fordblks`), mmapped chunks (`hblkhd`), the arenas' total
  (`arena`). torch's CPU tensors, SQLite's page cache
  and the tokenizer's buffers all come from malloc;
- with `--tracemalloc N`: the bytes Python allocations hold (N frames
  of traceback each), and a snapshot dumped to OUT/snapshot-NNN.pickle;
- the sizes of the caches that may grow: the store's resolved lists and
  known steps, the KV memory tier, gc's object count and the threads.

At the end (`Probe.finish`) the process calls `malloc_trim(0)` once and
records RSS before and after: what the trim gives back was free memory the
allocator kept (fragmentation), what stays is held. `main` (this file run
as a script) prints the samples' first-to-last growth and the snapshots'
top differences by traceback.
"""

from __future__ import annotations

import gc
import json
import pickle
import sys
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

from kvtrace.engine.heap import heap_stats, trim_heap

_MIB = 2**20


def mallinfo() -> dict[str, float]:
    """glibc's malloc counts in MiB (empty off glibc)."""
    stats = heap_stats()
    if stats is None:
        return {}
    return {"in_use": round(stats.in_use / _MIB, 2), "free_kept": round(stats.free_kept / _MIB, 2),
            "mmapped": round(stats.mapped / _MIB, 2), "arenas_total": round(stats.arenas / _MIB, 2)}


def rss_mib() -> dict[str, float]:
    """RSS, anonymous and file-backed resident pages of this process, in MiB."""
    wanted = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":")[0]
            if key in wanted:
                found[wanted[key]] = round(int(line.split()[1]) / 1024, 1)
    return found


class Probe:
    """Samples this process's memory every `every_s` seconds on a thread (module docstring)."""

    def __init__(self, folder: Path, *, every_s: float, frames: int, store: Any = None,
                 cache: Any = None) -> None:
        self.folder, self.every_s, self.frames = folder, every_s, frames
        self.store, self.cache = store, cache
        self._stop = threading.Event()
        self._count = 0
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kvtrace-probe")
        folder.mkdir(parents=True, exist_ok=True)

    def start(self) -> Probe:
        if self.frames:
            tracemalloc.start(self.frames)
        self._thread.start()
        return self

    def sample(self, label: str = "") -> dict[str, Any]:
        """One line of samples.jsonl (and a snapshot with tracemalloc on)."""
        row: dict[str, Any] = {"t": round(time.time(), 1), "label": label, **rss_mib(),
                               "malloc": mallinfo(), "threads": threading.active_count(),
                               "gc_objects": len(gc.get_objects())}
        if self.store is not None:
            row["store"] = self.store.held()
        if self.cache is not None:
            stats = self.cache.memory_stats()
            row["kv_memory"] = {"nodes": stats.num_entries, "tokens": stats.num_tokens,
                                "mib": round(stats.num_bytes / _MIB, 2)}
        if tracemalloc.is_tracing():
            current = tracemalloc.get_traced_memory()[0]
            row["python_mib"] = round(current / _MIB, 2)
            snapshot = tracemalloc.take_snapshot()
            with open(self.folder / f"snapshot-{self._count:03d}.pickle", "wb") as out:
                pickle.dump(snapshot, out)
            row["snapshot"] = self._count
            del snapshot
        self._count += 1
        with open(self.folder / "samples.jsonl", "a") as out:
            out.write(json.dumps(row) + "\n")
        return row

    def finish(self) -> None:
        """The last sample, then malloc_trim(0) and RSS once more (module docstring)."""
        self._stop.set()
        self._thread.join()
        gc.collect()
        self.sample("end")
        before = rss_mib()
        trimmed = trim_heap()
        with open(self.folder / "samples.jsonl", "a") as out:
            out.write(json.dumps({"label": "after malloc_trim(0)", "trimmed": trimmed,
                                  "before": before, **rss_mib(), "malloc": mallinfo()}) + "\n")

    def _loop(self) -> None:
        self.sample("start")
        while not self._stop.wait(self.every_s):
            self.sample()


# -- the soak's RSS budget ------------------------------------------------------------------

# What the server may keep besides the KV tensors the memory tier's budget counts, measured
# on the tiny model (docs/reliability.md, "The soak's RSS budget"): each node of the tier
# costs ~0.8-1.1 KiB of malloc (two tensors' structures) and ~1.1 KiB of Python objects
# for 15 tokens (the node, its children dict, its token tuple and the ints in it); each
# step the store's caches hold costs ~0.7-0.8 KiB (its id, its parent and skip pointers,
# its resolved list and the addresses new in it) plus a tuple slot per list item.
TIER_NODE_BYTES = 1024
TIER_TOKEN_BYTES = 80
STORE_STEP_BYTES = 1024
STORE_ITEM_BYTES = 8


def server_state(store: Any, cache: Any) -> dict[str, int]:
    """What the server holds that its RSS budget counts (printed by the soak's server)."""
    stats, held = cache.memory_stats(), store.held()
    return {"tier_nodes": stats.num_entries, "tier_tokens": stats.num_tokens,
            "tier_bytes": stats.num_bytes, "store_steps": held["known"],
            "store_lists": held["lists"], "store_list_items": held["list_items"]}


def rss_budget(memory_mib: int, other_mib: int, state: dict[str, int]) -> dict[str, float]:
    """The RSS growth the soak allows, in MiB, part by part (module constants).

    The memory tier's KV tensors up to its budget; the tier's own objects for
    what it holds at the end (bounded by the budget too: at most budget /
    KV bytes per token tokens); the store's caches for the steps they hold
    (the recorded run grows all soak long; the caches are emptied at 20,000
    steps); `other_mib` for the rest (SQLite's page cache, allocator slack).
    """
    tier = state["tier_nodes"] * TIER_NODE_BYTES + state["tier_tokens"] * TIER_TOKEN_BYTES
    store = (state["store_steps"] * STORE_STEP_BYTES
             + state["store_list_items"] * STORE_ITEM_BYTES)
    parts = {"kv_memory_tier": float(memory_mib), "tier_objects": tier / _MIB,
             "store_caches": store / _MIB, "other": float(other_mib)}
    return {**{k: round(v, 1) for k, v in parts.items()}, "total": round(sum(parts.values()), 1)}


def pid_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class RssSampler:
    """RSS of another process every half second on a thread: its peak, and one value
    every `every_s` seconds (how the growth goes over the run: does it level off?)."""

    def __init__(self, pid: int, every_s: float = 10.0) -> None:
        self.pid, self.every_s = pid, every_s
        self.start = self.peak = pid_rss_bytes(pid)
        self.series = [self.start]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.end = pid_rss_bytes(self.pid)
        self.series.append(self.end)

    def _sample(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.5):
            rss = pid_rss_bytes(self.pid)
            self.peak = max(self.peak, rss)
            if time.monotonic() - last >= self.every_s:
                self.series.append(rss)
                last = time.monotonic()


# -- reading the samples ----------------------------------------------------------------------


def _frames(stat: Any, keep: int) -> str:
    """The innermost `keep` frames of a statistic's traceback, kvtrace's first."""
    frames = list(stat.traceback)  # most recent call last (tracemalloc's default order)
    ours = [f for f in frames if "/kvtrace/" in f.filename]
    chosen = (ours[-keep:] if ours else []) + frames[-2:]
    seen, lines = set(), []
    for frame in chosen:
        where = f"{_short(frame.filename)}:{frame.lineno}"
        if where not in seen:
            seen.add(where)
            lines.append(where)
    return " <- ".join(reversed(lines))


def _short(filename: str) -> str:
    for marker in ("/site-packages/", "/kvtrace/", "/lib/python3.11/"):
        if marker in filename:
            return filename.split(marker, 1)[1] if marker != "/kvtrace/" else (
                "kvtrace/" + filename.split(marker, 1)[1])
    return filename


def report(folder: Path, *, top: int = 25) -> dict[str, Any]:
    """Growth from the first sample to the last, and the snapshots' top differences."""
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    first, last = rows[0], next(r for r in reversed(rows) if r.get("label") == "end")
    trim = rows[-1]
    growth = {key: round(last[key] - first[key], 1) for key in ("rss", "anon", "file")}
    growth["malloc"] = {key: round(last["malloc"][key] - first["malloc"][key], 2)
                        for key in first.get("malloc", {})}
    if "python_mib" in first:
        growth["python_mib"] = round(last["python_mib"] - first["python_mib"], 2)
    result: dict[str, Any] = {
        "samples": len(rows) - 1, "seconds": round(last["t"] - first["t"], 1),
        "first": first, "last": last, "growth": growth,
        "malloc_trim": {"rss_before": trim["before"]["rss"], "rss_after": trim["rss"]},
        "rss_series": [r["rss"] for r in rows[:-1]],
    }
    snapshots = sorted(folder.glob("snapshot-*.pickle"))
    if len(snapshots) >= 2:
        with open(snapshots[1 if len(snapshots) > 2 else 0], "rb") as fh:
            old = pickle.load(fh)  # the second: past the first requests' one-off allocations
        with open(snapshots[-1], "rb") as fh:
            new = pickle.load(fh)
        ignore = [tracemalloc.Filter(False, tracemalloc.__file__),
                  tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
        old, new = old.filter_traces(ignore), new.filter_traces(ignore)
        diffs = new.compare_to(old, "traceback")
        result["top_by_traceback"] = [
            {"kib": round(d.size_diff / 1024, 1), "count": d.count_diff,
             "where": _frames(d, 4)} for d in diffs[:top]]
        result["top_by_line"] = [
            {"kib": round(d.size_diff / 1024, 1), "count": d.count_diff,
             "where": f"{_short(d.traceback[0].filename)}:{d.traceback[0].lineno}"}
            for d in new.compare_to(old, "lineno")[:top]]
        result["snapshots_compared"] = [snapshots[1 if len(snapshots) > 2 else 0].name,
                                        snapshots[-1].name]
    return result


def type_counts(limit: int = 30) -> list[tuple[str, int]]:
    """The commonest types among gc-tracked objects (for a look by hand)."""
    return Counter(type(o).__name__ for o in gc.get_objects()).most_common(limit)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    print(json.dumps(report(Path(argv[0])), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
