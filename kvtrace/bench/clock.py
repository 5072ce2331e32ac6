"""Where a timed trial's wall time went: this process's CPU, the machine's, the scheduler.

Why: on a shared 2-core machine one trial of the same work can take 25 %
longer than the next. Wall time alone cannot say whether the process did
more work (its CPU time grows with it) or waited for a core that others
held (its CPU time stays, the machine's other CPU time and the
involuntary context switches grow). `TrialClock` reads, at the start and
the end of a block:

- wall time (`time.perf_counter`);
- this process's user and system CPU time, its voluntary and involuntary
  context switches and its minor page faults (`getrusage`);
- the machine's CPU time by state from /proc/stat (every CPU summed), so
  that the CPU time of everything else (`others_cpu_s`: busy time less
  ours) and time stolen by a hypervisor (`steal_s`) are known;
- /proc/loadavg.

`cpu_per_wall` is how many cores the process kept busy (torch computes on
two threads here: ~2.0 when nothing else runs). Off Linux the /proc
figures are None.
"""

from __future__ import annotations

import os
import resource
import time
from types import TracebackType
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_cpu() -> tuple[float, float, float] | None:
    """(busy, idle, steal) CPU seconds of the whole machine since boot (None off Linux)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy / _TICK, (idle + iowait) / _TICK, steal / _TICK


def _load() -> float | None:
    try:
        with open("/proc/loadavg") as loadavg:
            return float(loadavg.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class TrialClock:
    """`with TrialClock() as clock: ...` then `clock.figures()` (module docstring)."""

    def __enter__(self) -> TrialClock:
        self._load = _load()
        self._machine = _machine_cpu()
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self._wall = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.wall_s = time.perf_counter() - self._wall
        usage = resource.getrusage(resource.RUSAGE_SELF)
        machine = _machine_cpu()
        before = self._usage
        self.user_s = usage.ru_utime - before.ru_utime
        self.system_s = usage.ru_stime - before.ru_stime
        self.involuntary = usage.ru_nivcsw - before.ru_nivcsw
        self.voluntary = usage.ru_nvcsw - before.ru_nvcsw
        self.minor_faults = usage.ru_minflt - before.ru_minflt
        self.others_cpu_s = self.steal_s = self.idle_s = None
        if machine is not None and self._machine is not None:
            busy, idle, steal = (now - then for now, then in zip(machine, self._machine,
                                                                   strict=True))
            self.others_cpu_s = max(0.0, busy - self.user_s - self.system_s)
            self.idle_s, self.steal_s = idle, steal
        self.load = (self._load, _load())

    def figures(self) -> dict[str, Any]:
        """The block's figures, rounded, as JSON-ready values."""
        cpu = self.user_s + self.system_s

        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {
            "wall_s": round(self.wall_s, 3), "cpu_s": round(cpu, 3),
            "system_s": round(self.system_s, 3),
            "cpu_per_wall": round(cpu / self.wall_s, 3) if self.wall_s else None,
            "others_cpu_s": rounded(self.others_cpu_s), "idle_s": rounded(self.idle_s),
            "steal_s": rounded(self.steal_s), "involuntary_switches": self.involuntary,
            "voluntary_switches": self.voluntary, "minor_faults": self.minor_faults,
            "load_start": self.load[0], "load_end": self.load[1],
        }
