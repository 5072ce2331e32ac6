"""What a fork saves a short agent, start included: whole `kvtrace record` processes.

`kvtrace bench fork` (fork.py) times forks in one process with the model
loaded once. What a user runs is a fresh `kvtrace record` each time, whose
start (imports, the load, with `--from` the warm; docs/benchmarks.md) a
short agent's fork pays too, overlapped with the agent's own start, tools
and recorded calls (serve/loading.py). Here, with the agent of
fork_agent.py (`calls` calls of `max_tokens` tokens, each tool call taking
`tool_seconds`):

1. `base`: the agent recorded once (its KV blocks written to the disk tier).
2. `full_s`: the agent recorded again, on an empty KV cache: what re-running
   it costs.
3. `from_s`: `kvtrace record --from base@K`: the first K calls answered from
   the recording, the rest live, the model loading and warming meanwhile.

Cases 2 and 3 alternate `trials` times; the fastest of each counts. The
agent times its model calls, so `prefix_s` is what the fastest re-run spent
in its first K calls (the first one waits for the load), `saved_s =
full_s - from_s`, and `saved_share = saved_s / prefix_s`: how much of what
the recorded prefix cost the fork saved (1: all of it). The fork runs on the
base's disk tier, which holds the base's later calls too, so an unchanged
agent's live calls hit as well (as they would for a user forking a run
recorded here) and `saved_share` can pass 1; the re-runs start from an empty
KV cache each.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtrace.engine.memo import FINGERPRINTS_FILE, PROBES_FILE


def run_fork_start_bench(*, model: str | None = None, calls: int = 8, k: int = 5,
                         max_tokens: int = 24, tool_seconds: float = 0.5, trials: int = 2,
                         dtype: str = "auto") -> dict[str, Any]:
    """Time `kvtrace record` re-running the agent against `record --from base@K` (module
    docstring)."""
    from kvtrace.engine.folders import model_folder
    from kvtrace.paths import default_cache_dir

    if not 1 <= k < calls:
        raise ValueError(f"k must be in 1..{calls - 1}")
    folder = model_folder(model, default_cache_dir())  # converted once, before any timing
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        agent = ["--calls", str(calls), "--max-tokens", str(max_tokens),
                 "--tool-seconds", str(tool_seconds)]

        def record(name: str, cache: Path, *options: str) -> tuple[float, list[float], Any]:
            """One `kvtrace record` process, recording run `name`: its seconds, the agent's
            model calls', and its `--json` summary."""
            work, times = root / name, root / f"{name}.json"
            work.mkdir()
            env = {**os.environ, "KVTRACE_STORE": f"sqlite:///{root / 'bench.db'}",
                   "KVTRACE_CACHE": str(cache)}
            command = [sys.executable, "-m", "kvtrace", "record", "--model", str(folder),
                       "--dtype", dtype, "--run", name, "--json", *options, "--",
                       sys.executable, "-m", "kvtrace.bench.fork_agent", *agent,
                       "--times", str(times)]
            started = time.perf_counter()
            done = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True,
                                  check=False)
            seconds = time.perf_counter() - started
            if done.returncode != 0:
                raise RuntimeError(f"kvtrace record ({name}) exited {done.returncode}: "
                                   f"{done.stderr.strip()[-2000:]}")
            return seconds, json.loads(times.read_text()), json.loads(done.stdout)

        base_cache = root / "cache"
        record("base", base_cache)
        full: list[tuple[float, list[float], Any]] = []
        forked: list[float] = []
        summary: dict[str, Any] = {}
        for trial in range(trials):
            fresh = root / f"cache-{trial}"  # an empty KV cache; what loads remember kept
            fresh.mkdir()
            for memo in (FINGERPRINTS_FILE, PROBES_FILE):  # as a user re-running here has
                if (base_cache / memo).is_file():
                    shutil.copy(base_cache / memo, fresh / memo)
            full.append(record(f"rerun-{trial}", fresh))
            seconds, _, said = record(f"from-{trial}", base_cache, "--from", f"base@{k}")
            forked.append(seconds)
            summary = said["from"]
    full_s, calls_s, _ = min(full, key=lambda case: case[0])
    from_s = min(forked)
    prefix_s = sum(calls_s[:k])
    return {
        "model": folder.name, "calls": calls, "k": k, "max_tokens": max_tokens,
        "tool_seconds": tool_seconds, "trials": trials,
        "full_s": round(full_s, 3), "from_s": round(from_s, 3),
        "full_s_trials": [round(case[0], 3) for case in full],
        "from_s_trials": [round(s, 3) for s in forked],
        "ratio": round(from_s / full_s, 3),
        "prefix_s": round(prefix_s, 3), "saved_s": round(full_s - from_s, 3),
        "saved_share": round((full_s - from_s) / prefix_s, 3),
        "first_call_s": round(calls_s[0], 3),
        "from": summary,
    }
