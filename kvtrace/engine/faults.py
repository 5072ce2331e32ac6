"""What the disk tier recovered from: recorded so that it is shown, not only counted.

The disk tier is a cache, so its faults never stop a computation:

- a block that cannot be written (a full or read-only folder) stays
  uncached, and the sequence's later blocks are not attempted (they would
  hang from a parent that is not there);
- a block that fails its checks on read (damaged, truncated, another
  model's) is deleted and its tokens recomputed.

Each one is logged here (the block's key, and why) until whoever runs the
computation takes the log (`KVCache.take_disk_faults`; replay turns it into
notes of its report). Failed writes are also counted on disk, in
`<kv folder>/write-failures.json`, for `kvtrace cache stats` in any later
process: best effort, since a read-only folder (or one with no page left)
cannot take even that file; `cache stats` then also says the folder is
read-only or full, which is why writes fail.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

WRITE_FAILURES_FILE = "write-failures.json"
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

    def __bool__(self) -> bool:
        return bool(self.num_failed_writes or self.num_damaged)


class FaultLog:
    """A thread-safe log of one folder's faults (the write-behind thread logs too)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._num_failed_writes = 0
        self._write_reasons: dict[str, None] = {}
        self._num_damaged = 0
        self._damaged: list[BlockFault] = []

    def failed_write(self, reason: str) -> None:
        with self._lock:
            self._num_failed_writes += 1
            if len(self._write_reasons) < MAX_WRITE_REASONS:
                self._write_reasons.setdefault(reason)

    def damaged(self, key: str, reason: str, *, is_deleted: bool = True) -> None:
        with self._lock:
            self._num_damaged += 1
            if len(self._damaged) < MAX_LOGGED_BLOCKS:
                self._damaged.append(BlockFault(key, reason, is_deleted))

    def take(self) -> DiskFaults:
        """Everything logged since the last `take`, and an empty log."""
        with self._lock:
            faults = DiskFaults(
                folder=str(self.folder),
                num_failed_writes=self._num_failed_writes,
                write_reasons=tuple(self._write_reasons),
                num_damaged=self._num_damaged,
                damaged=tuple(self._damaged),
            )
            self._num_failed_writes = self._num_damaged = 0
            self._write_reasons = {}
            self._damaged = []
        return faults


@dataclass(frozen=True, slots=True)
class WriteFailureCount:
    """Failed block writes counted on disk, across processes (`count_failed_write`)."""

    num_failed_writes: int = 0
    last_reason: str | None = None
    last_failed_at: float | None = None  # Unix time


def count_failed_write(folder: Path, reason: str) -> bool:
    """Add one to the folder's failed-write count; False when the folder cannot take it.

    The file is rewritten in place under an exclusive lock (concurrent
    processes add up; an in-place rewrite of a few bytes needs no new space
    on a full disk, where a temporary file would).
    """
    path = folder / WRITE_FAILURES_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "r+", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            count = _parse(fh.read())
            record = {
                "num_failed_writes": count.num_failed_writes + 1,
                "last_reason": reason[:500],
                "last_failed_at": time.time(),
            }
            fh.seek(0)
            fh.write(json.dumps(record, sort_keys=True))
            fh.truncate()
        return True
    except OSError:
        return False


def read_failed_writes(folder: Path) -> WriteFailureCount:
    """The folder's failed-write count (zero when none was ever counted)."""
    with contextlib.suppress(OSError):
        return _parse((folder / WRITE_FAILURES_FILE).read_text(encoding="utf-8"))
    return WriteFailureCount()


def _parse(text: str) -> WriteFailureCount:
    try:
        data = json.loads(text) if text.strip() else {}
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    num = data.get("num_failed_writes")
    reason = data.get("last_reason")
    at = data.get("last_failed_at")
    return WriteFailureCount(
        num_failed_writes=num if isinstance(num, int) and num >= 0 else 0,
        last_reason=reason if isinstance(reason, str) else None,
        last_failed_at=float(at) if isinstance(at, int | float) else None,
    )
