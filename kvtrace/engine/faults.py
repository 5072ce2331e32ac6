"""What the disk tier recovered from: recorded so that it is shown, not only counted.

The disk tier is a cache, so its faults never stop a computation:

- a block that cannot be written (a full or read-only folder) stays
  uncached, and the sequence's later blocks are not attempted (they would
  hang from a parent that is not there);
- a block that fails its checks on read (damaged, truncated, another
  model's) is deleted and its tokens recomputed;
- past the folder's budget (`$KVTRACE_KV_DISK_MAX`), the least recently used
  tail blocks are evicted: a later process recomputes their tokens.

Each one is logged here (the block's key, and why) until whoever runs the
computation takes the log (`KVCache.take_disk_faults`; replay turns it into
notes of its report, `serve` and `record` into their closing lines:
`disk_faults_lines`). Failed writes and evictions are also counted on disk,
in `<kv folder>/write-failures.json`, for `kvtrace cache stats` in any later
process. That record is a fixed-size one, rewritten in place, so a disk
that filled up since it was made still takes the update (a rewrite within
its page needs no new space); where the folder cannot take it (read-only,
or full before the record existed), the count goes to a file of the same
name under the system's temporary folder, one per KV folder
(`fallback_path`), and `cache stats` adds the two. Where neither takes a
failed write, the log says how many were not counted (`num_uncounted`), and
the closing line says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

WRITE_FAILURES_FILE = "write-failures.json"
_RECORD_BYTES = 1024  # the count's record, padded: rewritten in place, it never grows
MAX_LOGGED_BLOCKS = 64  # damaged blocks named in one log (the count goes on)
MAX_WRITE_REASONS = 8  # distinct reasons kept in one log (a log nobody takes stays small)


@dataclass(frozen=True, slots=True)
class BlockFault:
    """A block found damaged: its key, why it was refused, and whether its file is gone."""

    key: str
    reason: str
    is_deleted: bool = True  # False on a read-only folder: refused again at every read


@dataclass(frozen=True, slots=True)
class DiskFaults:
    """What a disk tier recovered from since its log was last taken.

    `write_reasons` are the distinct reasons writes failed, first seen first
    (at most `MAX_WRITE_REASONS`);
    `damaged` names at most `MAX_LOGGED_BLOCKS` blocks (`num_damaged` counts
    them all).
    """

    folder: str
    num_failed_writes: int = 0
    write_reasons: tuple[str, ...] = ()
    num_damaged: int = 0
    damaged: tuple[BlockFault, ...] = ()
    num_uncounted: int = 0  # failed writes no file could count (`cache stats` misses them)
    num_evicted_blocks: int = 0  # evicted past the budget
    num_evicted_bytes: int = 0
    disk_budget: int | None = None  # the budget they were evicted at

    def __bool__(self) -> bool:
        return bool(self.num_failed_writes or self.num_damaged or self.num_evicted_blocks)

    def plus(self, other: DiskFaults) -> DiskFaults:
        """Both logs as one (a write-behind thread's and its cache's; a replay's steps)."""
        return DiskFaults(
            folder=other.folder or self.folder,
            num_failed_writes=self.num_failed_writes + other.num_failed_writes,
            write_reasons=tuple(dict.fromkeys(self.write_reasons + other.write_reasons)),
            num_damaged=self.num_damaged + other.num_damaged,
            damaged=self.damaged + other.damaged,
            num_uncounted=self.num_uncounted + other.num_uncounted,
            num_evicted_blocks=self.num_evicted_blocks + other.num_evicted_blocks,
            num_evicted_bytes=self.num_evicted_bytes + other.num_evicted_bytes,
            disk_budget=other.disk_budget if other.disk_budget is not None else self.disk_budget,
        )


class FaultLog:
    """A thread-safe log of one folder's faults (the write-behind thread logs too)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._num_failed_writes = 0
        self._write_reasons: dict[str, None] = {}
        self._num_damaged = 0
        self._damaged: list[BlockFault] = []
        self._num_uncounted = 0
        self._num_evicted_blocks = self._num_evicted_bytes = 0
        self._disk_budget: int | None = None

    def failed_write(self, reason: str, *, is_counted: bool = True) -> None:
        """One failed write; `is_counted=False`: no file could count it (module docstring)."""
        with self._lock:
            self._num_failed_writes += 1
            self._num_uncounted += not is_counted
            if len(self._write_reasons) < MAX_WRITE_REASONS:
                self._write_reasons.setdefault(reason)

    def damaged(self, key: str, reason: str, *, is_deleted: bool = True) -> None:
        with self._lock:
            self._num_damaged += 1
            if len(self._damaged) < MAX_LOGGED_BLOCKS:
                self._damaged.append(BlockFault(key, reason, is_deleted))

    def evicted(self, num_blocks: int, num_bytes: int, budget: int) -> None:
        """Blocks evicted to bring the folder back under `budget` bytes."""
        with self._lock:
            self._num_evicted_blocks += num_blocks
            self._num_evicted_bytes += num_bytes
            self._disk_budget = budget

    def take(self) -> DiskFaults:
        """Everything logged since the last `take`, and an empty log."""
        with self._lock:
            faults = DiskFaults(
                folder=str(self.folder),
                num_failed_writes=self._num_failed_writes,
                write_reasons=tuple(self._write_reasons),
                num_damaged=self._num_damaged,
                damaged=tuple(self._damaged),
                num_uncounted=self._num_uncounted,
                num_evicted_blocks=self._num_evicted_blocks,
                num_evicted_bytes=self._num_evicted_bytes,
                disk_budget=self._disk_budget,
            )
            self._num_failed_writes = self._num_damaged = self._num_uncounted = 0
            self._num_evicted_blocks = self._num_evicted_bytes = 0
            self._disk_budget = None
            self._write_reasons = {}
            self._damaged = []
        return faults


@dataclass(frozen=True, slots=True)
class DiskRecord:
    """What a KV folder's disk tier lost, counted on disk across processes
    (`count_failed_write`, `count_evictions`)."""

    num_failed_writes: int = 0
    last_reason: str | None = None
    last_failed_at: float | None = None  # Unix time
    num_evicted_blocks: int = 0  # past the budget

    def plus(self, other: DiskRecord) -> DiskRecord:
        last = max(self, other, key=lambda r: r.last_failed_at or 0.0)
        return DiskRecord(self.num_failed_writes + other.num_failed_writes, last.last_reason,
                          last.last_failed_at,
                          self.num_evicted_blocks + other.num_evicted_blocks)


def count_failed_write(folder: Path, reason: str) -> bool:
    """Add one to the folder's failed-write count, in its own record or else in the
    fallback's (module docstring); False when neither could take it."""
    one = DiskRecord(1, reason[:120], time.time())
    return _add(folder / WRITE_FAILURES_FILE, one) or _add(fallback_path(folder), one)


def count_evictions(folder: Path, num_blocks: int) -> None:
    """Add `num_blocks` evictions to the folder's record (or the fallback's)."""
    evicted = DiskRecord(num_evicted_blocks=num_blocks)
    _add(folder / WRITE_FAILURES_FILE, evicted) or _add(fallback_path(folder), evicted)


def reserve_count(folder: Path) -> None:
    """Make the folder's count record now, while there is room: a later update rewrites it in
    place, which a disk that filled up meanwhile still takes."""
    path = folder / WRITE_FAILURES_FILE
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(_record(DiskRecord()))


def fallback_path(folder: Path) -> Path:
    """Where a folder's failed writes are counted when the folder cannot take its record."""
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"kvtrace-{os.getuid()}-{digest}-{WRITE_FAILURES_FILE}"


def read_disk_record(folder: Path) -> DiskRecord:
    """The folder's counts (zero when none was ever counted): its record's and the
    fallback's, added."""
    record = DiskRecord()
    for path in (folder / WRITE_FAILURES_FILE, fallback_path(folder)):
        with contextlib.suppress(OSError):
            record = record.plus(_parse(path.read_text(encoding="utf-8")))
    return record


def disk_faults_lines(faults: DiskFaults | None) -> list[str]:
    """What a command's closing lines (and replay's notes) say of lost writes and evictions."""
    if not faults:
        return []
    lines = []
    if faults.num_failed_writes:
        lines.append(failed_writes_line(faults.num_failed_writes, faults.write_reasons,
                                        faults.folder, faults.num_uncounted))
    if faults.num_evicted_blocks:
        lines.append(evictions_line(faults.num_evicted_blocks, faults.num_evicted_bytes,
                                    faults.disk_budget, faults.folder))
    return lines


def evictions_line(num_blocks: int, num_bytes: int, budget: int | None, folder: str) -> str:
    """The line for blocks evicted past the disk budget."""
    blocks = f"{num_blocks} KV block{'' if num_blocks == 1 else 's'}"
    return (f"the disk tier reached its budget of {_bytes(budget)} ($KVTRACE_KV_DISK_MAX, "
            f"{folder}): {blocks} ({_bytes(num_bytes)}) were evicted, least recently used "
            "first, so a later process recomputes those tokens; raise the budget to keep more")


def failed_writes_line(num_failed: int, reasons: tuple[str, ...] | list[str], folder: str,
                       num_uncounted: int = 0) -> str:
    """What replay's note and serve's and record's closing line say of failed writes."""
    blocks = f"{num_failed} KV block{'' if num_failed == 1 else 's'}"
    them = "it" if num_failed == 1 else "them"
    line = (f"{blocks} could not be written to the disk tier ({'; '.join(reasons)}: {folder}); "
            f"the work went on without {them}, so a later process recomputes those tokens")
    if num_uncounted:
        return (line + f"; {num_uncounted} of these could not be counted anywhere either, so "
                "`kvtrace cache stats` does not show them")
    return line + " (`kvtrace cache stats` counts failed writes)"


def _bytes(num: int | None) -> str:
    if num is None:
        return "(unknown)"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num >= size:
            return f"{num / size:,.1f} {unit}"
    return f"{num:,} B"


def _add(path: Path, change: DiskRecord) -> bool:
    """Add `change` to the record at `path`, rewritten in place under an exclusive lock
    (concurrent processes add up)."""
    try:  # never through a link planted in a shared folder
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "r+", encoding="utf-8") as fh:
            if os.fstat(fh.fileno()).st_uid != os.getuid():
                return False
            fcntl.flock(fh, fcntl.LOCK_EX)
            record = _parse(fh.read()).plus(change)
            fh.seek(0)
            fh.write(_record(record))
            fh.truncate()  # an older, longer record: shrinking needs no space
        return True
    except OSError:
        return False


def _record(record: DiskRecord) -> str:
    text = json.dumps({"num_failed_writes": record.num_failed_writes,
                       "last_reason": record.last_reason,
                       "last_failed_at": record.last_failed_at,
                       "num_evicted_blocks": record.num_evicted_blocks}, sort_keys=True)
    return text.ljust(_RECORD_BYTES)


def _parse(text: str) -> DiskRecord:
    try:
        data = json.loads(text) if text.strip() else {}
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    num = data.get("num_failed_writes")
    reason = data.get("last_reason")
    at = data.get("last_failed_at")
    evicted = data.get("num_evicted_blocks")
    return DiskRecord(
        num_failed_writes=num if isinstance(num, int) and num >= 0 else 0,
        last_reason=reason if isinstance(reason, str) else None,
        last_failed_at=float(at) if isinstance(at, int | float) else None,
        num_evicted_blocks=evicted if isinstance(evicted, int) and evicted >= 0 else 0,
    )
