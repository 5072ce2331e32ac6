"""Other work on the same cores, on purpose: a benchmark's `--contend N`.

A laptop or a shared box always runs something else. `contention(n)` starts
`n` processes that each keep one core busy (a tight loop of integer work,
no memory traffic to speak of, as a compiler or a test runner is mostly)
for as long as the block runs, so a benchmark can time a server both quiet
and loaded, in one run. With one busy process per core, every thread a
server runs competes with one of them; a server whose threads wait for each
other at every step (an OpenMP team's barrier) waits there for a thread that
is not running.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_BUSY = "while True:\n    pass\n"


@contextmanager
def contention(n: int) -> Iterator[None]:
    """`n` busy processes alongside the block (none for 0); stopped when it ends."""
    if n < 0:
        raise ValueError("--contend takes a number of processes, 0 or more")
    processes = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(n)]
    try:
        yield
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()
