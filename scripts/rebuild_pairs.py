"""Paired trials of the agent rebuild against its feed-only bound, with peak RSS.

Why: on a shared 2-core machine one trial can run 25 % slower than the next,
so the fastest of two rebuilds over the fastest of two bounds (what `kvtrace
bench replay` reports) moves by more than the 1.15 target's margin. Here
each rebuild runs right before its bound, and the ratio of each pair and
their median are printed, with each rebuild's peak RSS and how much it grew,
and where each one's wall time went (kvtrace/bench/clock.py: this process's
CPU time and context switches, the CPU time of everything else on the
machine, the load): a slow trial whose CPU time is the fast ones' waited
for a core; one whose CPU time grew did more work, or worked slower.

Usage: .venv/bin/python scripts/rebuild_pairs.py [PAIRS]   (default 4; needs the
agent fixture, which `kvtrace bench replay --shape agent` records once).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from kvtrace.bench.agent import AGENT_RECIPE, NUM_CALLS
from kvtrace.bench.clock import TrialClock
from kvtrace.bench.replay import lower_bound_seconds
from kvtrace.bench.rss import PeakRss, runtime_rss_mb
from kvtrace.engine import KVCache, load_engine, prefill
from kvtrace.paths import default_cache_dir
from kvtrace.replay import replay
from kvtrace.replay.local import LocalBackend
from kvtrace.store import open_store


def main(pairs: int) -> dict[str, object]:
    cache_dir = default_cache_dir()
    engine = load_engine(None, cache_dir=cache_dir)
    store = open_store(f"sqlite:///{cache_dir / 'bench' / 'replay' / 'store.db'}")
    name = f"{AGENT_RECIPE}-{NUM_CALLS}-{engine.fingerprint[:12]}"
    if name not in {run.name for run in store.runs()}:
        raise SystemExit("no agent fixture yet: run `kvtrace bench replay --shape agent` once")
    prefill(engine, None, [0] * 16)  # every weight page resident before RSS is read
    resident = runtime_rss_mb()  # runtime and model, before anything computed a run
    lower_bound_seconds(store, name, engine, decode=False)  # the process's warm-up, untimed
    rows = []
    for _ in range(pairs):
        with tempfile.TemporaryDirectory(prefix="kvtrace-pairs-") as tmp:
            cache = KVCache(engine, disk_dir=Path(tmp) / "kv")
            with PeakRss() as peak, TrialClock() as rebuild_clock:
                report = replay(store, name, LocalBackend(engine, cache), mode="rebuild")
            del cache
        with TrialClock() as bound_clock:
            bound, _ = lower_bound_seconds(store, name, engine, decode=False)
        rows.append({
            "rebuild_s": round(report.wall_s, 3),
            "feed_bound_s": round(bound, 3),
            "ratio": round(report.wall_s / bound, 3),
            "peak_rss_mb": round(peak.mb, 1),
            "rss_growth_mb": round(peak.mb - peak.start_mb, 1),
            "peak_over_resident_mb": round(peak.mb - resident, 1),
            # the same pair in CPU time: the work's ratio, whatever the machine did meanwhile
            "cpu_ratio": round(rebuild_clock.figures()["cpu_s"] / bound_clock.figures()["cpu_s"],
                               3),
            "rebuild_clock": rebuild_clock.figures(),
            "bound_clock": bound_clock.figures(),
        })
    store.close()
    return {
        "pairs": rows,
        "median_ratio": round(statistics.median(r["ratio"] for r in rows), 3),
        "median_cpu_ratio": round(statistics.median(r["cpu_ratio"] for r in rows), 3),
        "resident_rss_mb": round(resident, 1),
        "kv_bytes_per_token": engine.kv_bytes_per_token,
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 4), indent=2))
