"""Resident memory of this process: now, and the peak over a block of code.

`ru_maxrss` is the peak of the whole process (the model load, earlier
cases); a rebuild's own peak needs sampling while it runs. `PeakRss` reads
`/proc/self/statm` from a thread every few milliseconds (Linux; elsewhere
it reports the value at entry and exit only).
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MB = 1024 * 1024


def runtime_rss_mb() -> float:
    """The resident set size of this process now, in MiB (0.0 when unknown)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE / _MB
    except (OSError, ValueError, IndexError):
        return 0.0


class PeakRss:
    """`with PeakRss() as peak: ...` then `peak.mb` (peak) and `peak.start_mb`."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.start_mb = 0.0
        self.mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self.start_mb = self.mb = runtime_rss_mb()
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.mb = max(self.mb, runtime_rss_mb())

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.mb = max(self.mb, runtime_rss_mb())
