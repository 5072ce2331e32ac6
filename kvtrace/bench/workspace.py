"""`kvtrace bench workspace`: what a workspace snapshot costs where little changed.

The case `record --workspace` meets before every model call of a coding
agent: a folder of `num_files` files (`total_mb` in all), of which
`num_changed` change between two calls. Files are random bytes (nothing
compresses: the worst case for the store's growth). Measured:

- `snapshot_ms_p50` / `p95`: one `Snapshotter.take` after `num_changed` files
  were rewritten (target: 5 ms for 1,000 files, 50 MB, 3 changed), and the
  first, cold snapshot that reads every file (`first_snapshot_ms`);
- `growth_over_changed`: the store's bytes added by the timed snapshots over
  the distinct bytes that changed (target: at most 1.1), the trees' deltas
  included; and `unchanged_ms_p50`: a snapshot where nothing changed.

Files are backdated, as a folder edited a few seconds ago is: the stat
index trusts only settled mtimes (snapshot.py), so the files a round
rewrites are read (their mtime moved), and the rest are not. By default the
snapshotter watches the folder (inotify, workspace/changes.py) and stats only
what changed; `watch=False` (`--no-watch`) walks it every time. `walks`
says how many snapshots walked.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from kvtrace.store import open_store
from kvtrace.store.db.schema import blobs
from kvtrace.workspace import Snapshotter


def run_workspace_bench(*, num_files: int = 1000, total_mb: float = 50.0,
                        num_changed: int = 3, rounds: int = 30,
                        watch: bool = True) -> dict[str, Any]:
    file_bytes = int(total_mb * 1_000_000 / num_files)
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-workspace-") as tmp:
        folder = Path(tmp) / "work"
        for i in range(num_files):
            sub = folder / f"pkg{i % 20:02}"
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"module_{i:04}.bin").write_bytes(os.urandom(file_bytes))
        paths = sorted(folder.rglob("*.bin"))
        _backdate(paths)
        with open_store(f"sqlite:///{Path(tmp) / 'store.db'}") as store:
            shots = Snapshotter(store, folder, watch=watch)
            started = time.perf_counter()
            shots.take()
            first_ms = (time.perf_counter() - started) * 1000
            unchanged = [_timed(shots.take) for _ in range(5)]
            before = _stored_bytes(store)
            changed_bytes, timings, read = 0, [], []
            for r in range(rounds):
                edited = paths[r * num_changed:(r + 1) * num_changed]
                for path in edited:
                    path.write_bytes(os.urandom(file_bytes))
                    changed_bytes += file_bytes
                _backdate(edited, seconds=30.0 - r)  # a new mtime, settled
                timings.append(_timed(shots.take))
                read.append(shots.num_files_read)
            growth = _stored_bytes(store) - before
            walks = shots.num_walks
            shots.close()
    timings.sort()
    return {
        "num_files": num_files, "total_bytes": file_bytes * num_files,
        "num_changed": num_changed, "rounds": rounds,
        "first_snapshot_ms": round(first_ms, 2),
        "unchanged_ms_p50": round(statistics.median(unchanged), 3),
        "snapshot_ms_p50": round(statistics.median(timings), 3),
        "snapshot_ms_p95": round(timings[int(0.95 * (len(timings) - 1))], 3),
        "files_read_per_snapshot": max(read),
        "walks": walks,  # snapshots that walked the whole folder (1: the first; else events)
        "changed_bytes": changed_bytes, "store_growth_bytes": growth,
        "growth_over_changed": round(growth / changed_bytes, 4),
        "targets": {"snapshot_ms_p50 <= 5": statistics.median(timings) <= 5.0,
                    "growth_over_changed <= 1.1": growth / changed_bytes <= 1.1},
    }


def _timed(take: Any) -> float:
    started = time.perf_counter()
    take()
    return (time.perf_counter() - started) * 1000


def _backdate(paths: list[Path], seconds: float = 60.0) -> None:
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then))


def _stored_bytes(store: Any) -> int:
    """What the blobs table keeps (the rows' data, as stored: compressed or deltas)."""
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.coalesce(
            sa.func.sum(sa.func.length(blobs.c.data)), 0))).scalar_one())
