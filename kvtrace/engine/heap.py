"""Give a long-lived engine's freed heap pages back: `HeapTrimmer`, and glibc's counts.

Why: torch's CPU tensors are plain malloc. glibc serves a request of 128
KiB or more with a mapping of its own at first, but when it frees such a
chunk it raises that threshold to the chunk's size (up to 32 MiB, its
"dynamic mmap threshold"), so a forward's activations soon come from the
heap arenas, reused from call to call with no page faults. In `kvtrace
serve` those transient chunks share the arenas with long-lived ones (the
memory tier's KV segments, the store's caches, Python objects): a freed
transient chunk is split for small long-lived requests, the next one no
longer fits and extends the heap, and the freed pages around each
long-lived chunk stay resident. RSS then grows for as long as the server
keeps new things (+166-172 MiB in 180 s of the soak on the tiny model,
~110 MiB of it free bytes glibc kept: docs/reliability.md, "Where the
soak's RSS went"), though `malloc_trim(0)` gives those pages back.

Two ways out, measured. Fixing the threshold at 128 KiB (what the server
did before, `mallopt(M_MMAP_THRESHOLD)`) maps and unmaps every transient
tensor of that size, and the page faults made the server's prefill
1.3-1.6x slower than the same work in one process (docs/benchmarks.md).
Keeping glibc's default and trimming instead costs a
`malloc_trim(0)` now and then: `HeapTrimmer` tells the engine thread when,
after `IDLE_TRIM_S` without work and every `BUSY_TRIM_S` of continuous
work, between forwards (never during one). One-shot commands (replay,
analyze) do not trim: their fragmentation ends with the process.

`heap_stats()` reads glibc's counts (`mallinfo2`), for the soak's probe
and the tests. Importing this module loads no library: `ctypes` finds glibc
when called; off glibc, trimming does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from dataclasses import dataclass
from functools import cache
from typing import Any

IDLE_TRIM_S = 1.0  # an engine thread this long without work trims what its work left
BUSY_TRIM_S = 5.0  # and trims at least this often while it works


@dataclass(frozen=True, slots=True)
class HeapStats:
    """glibc's malloc counts, in bytes (`mallinfo2`, summed over every arena)."""

    in_use: int  # uordblks: chunks handed out from the arenas
    free_kept: int  # fordblks: free chunks the arenas keep (resident when touched before)
    mapped: int  # hblkhd: chunks served by their own mapping
    arenas: int  # arena: bytes the arenas took from the kernel


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@cache
def _glibc() -> Any:
    """glibc, when this process runs on it (None elsewhere: musl, macOS, Windows)."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallinfo2") or not hasattr(libc, "malloc_trim"):
        return None  # not glibc, or older than 2.33
    libc.mallinfo2.restype = _MallInfo2
    return libc


def heap_stats() -> HeapStats | None:
    """glibc's counts now (None off glibc)."""
    libc = _glibc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return HeapStats(in_use=info.uordblks, free_kept=info.fordblks, mapped=info.hblkhd,
                     arenas=info.arena)


def trim_heap() -> bool:
    """Give the arenas' free pages back to the kernel (`malloc_trim(0)`); whether any were."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


class HeapTrimmer:
    """When an engine thread gives the heap's free pages back (module docstring).

    The thread calls `worked()` after each unit of work (a trim when it has
    worked `busy_s` since its first work after the last trim: a request
    after a pause is not trimmed in the middle), waits at most `idle_wait()`
    seconds for the next (None: nothing to trim, wait as long as it takes),
    and calls `trim()` when that wait ran out. One thread's object.
    """

    def __init__(self, *, idle_s: float = IDLE_TRIM_S, busy_s: float = BUSY_TRIM_S) -> None:
        self.idle_s = idle_s
        self.busy_s = busy_s
        self.num_trims = 0
        self._busy_since = 0.0  # the first work after the last trim
        self._is_owed = False  # work was done since the last trim

    def worked(self) -> None:
        now = time.monotonic()
        if not self._is_owed:
            self._busy_since = now
            self._is_owed = True
        if now - self._busy_since >= self.busy_s:
            self.trim()

    def idle_wait(self) -> float | None:
        return self.idle_s if self._is_owed else None

    def trim(self) -> None:
        trim_heap()
        self.num_trims += 1
        self._is_owed = False
