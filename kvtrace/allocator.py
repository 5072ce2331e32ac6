"""The C allocator's setting a long-lived engine process needs: a fixed mmap threshold.

Why: glibc's malloc serves a request of 128 KiB or more with a mapping of
its own, which `free` gives back to the kernel. But when it frees such a
chunk, glibc raises the threshold to that chunk's size (up to 32 MiB, its
"dynamic mmap threshold"), and from then on requests up to that size come
from the heap arenas. torch's CPU tensors are plain malloc: in `kvtrace
serve`, transient ones (the logits of each decoding step, 192 KiB for a
49,152-token vocabulary, and a forward's activations) are then carved from
the same arenas as the long-lived ones (the memory tier's KV segments, the
store's caches, Python objects). A freed transient chunk is split to serve
small long-lived requests, the next transient one no longer fits in what is
left and extends the heap, and the pages around each long-lived chunk stay
resident: freed, but never returned. RSS then grows for as long as the
server keeps new things (docs/reliability.md, "Where the soak's RSS went":
+166-172 MiB in 180 s on the tiny model, 103-110 MiB of it free bytes
glibc kept; with the threshold fixed, +3 MiB of those).

`steady_heap()` fixes the threshold at glibc's own starting value with
`mallopt(M_MMAP_THRESHOLD, ...)`, which also stops the raising, so every
tensor of 128 KiB or more is mapped and unmapped on its own again. It does
nothing when the environment already chose (`MALLOC_MMAP_THRESHOLD_`, which
glibc reads at start) or off glibc. The server calls it when it serves a
local engine; one-shot commands (replay, analyze) keep glibc's default,
whose reuse of freed heap chunks saves the page faults of fresh mappings
and whose fragmentation ends with the process. `heap_stats()` reads
glibc's counts (`mallinfo2`), for the soak's probe and the tests.

Importing this module loads no library: `ctypes` finds glibc when called.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's starting value (DEFAULT_MMAP_THRESHOLD_MIN)
ENV_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


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
    if not hasattr(libc, "mallinfo2") or not hasattr(libc, "mallopt"):
        return None  # not glibc, or older than 2.33
    libc.mallinfo2.restype = _MallInfo2
    return libc


def steady_heap(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold (module docstring); whether this call set it."""
    libc = _glibc()
    if libc is None or ENV_THRESHOLD in os.environ:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))


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
