"""How many threads the engine computes on: the cores that other processes leave free.

torch runs each operation on an OpenMP team, whose threads meet at a
barrier after every parallel region, hundreds of times per forward. While
every team thread has a core, that costs microseconds. When another process
keeps a core busy, the scheduler shares that core between it and one of the
team's threads, and every barrier then waits, often a whole time slice, for
the thread that is not running. Measured on a 2-core AVX-512 EPYC
(2026-12-05, bfloat16, docs/benchmarks.md "Under load"): with one busy
process per core, two cold 1,000-token prefills took 8.4 s on two threads
against 4.8 s on one (2.3 s quiet, on two); 128 decoded tokens 21.1 s
against 10.2 s (5.1 s quiet). One thread has no barrier to wait at.

So a sampler thread looks every `INTERVAL_S` at how busy the CPUs this
process may run on were over the last interval, less this process's own
time (psutil's per-CPU times; `os.times`), and `ThreadBudget.adjust`, called
before each prefill and decode step, runs on the cores left free (a core
is taken once others keep it three-quarters busy): at least one, at most the
count torch started with (the user's `OMP_NUM_THREADS`,
else torch's default, one per physical core). A machine whose other
processes come and go gets the team back within a second.

Fidelity: a cache hit must give the bits a cold run gives, and the cold run
may have run on another thread count. `load_engine` checks that the model's
matrix products give the same bits on every count the budget may choose as
on all (`threads_are_invariant`, next to the row check in numerics.py, for
decode's 1 row and prefill's 16 to 512); where they do not, and for every
window or state model (whose own kernels run beside the products, unchecked),
the budget stays fixed at the starting count, which the engine's fingerprint
then names. `KVTRACE_THREADS=N`
fixes it at N (benchmarks that time one configuration; a user who knows
better).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import torch

INTERVAL_S = 0.5
THREADS_ENV = "KVTRACE_THREADS"


class ThreadBudget:
    """The engine's thread count, following the cores other processes leave free."""

    def __init__(self, *, most: int | None = None, adapts: bool = True) -> None:
        fixed = os.environ.get(THREADS_ENV)
        if fixed is not None:
            try:
                most, adapts = max(1, int(fixed)), False
            except ValueError:
                raise ValueError(f"{THREADS_ENV}={fixed!r}: give a number of threads") from None
        self.most = most or torch.get_num_threads()
        self.adapts = adapts and self.most > 1
        self.why_fixed: str | None = None if self.adapts else (
            f"{THREADS_ENV}={fixed}" if fixed is not None
            else "one thread" if self.most == 1 else "asked")
        self._cpus = _allowed_cpus()
        self._lock = threading.Lock()
        self._free = self.most  # the sampler's latest count
        self._pinned: int | None = None
        if self.adapts:
            threading.Thread(target=self._sample, name="kvtrace-threads", daemon=True).start()

    def hold(self, why: str) -> None:
        """Stop adapting: compute on the starting count from now on, because of `why`."""
        with self._lock:
            self.adapts = False
            self.why_fixed = self.why_fixed or why

    @contextmanager
    def pinned(self, threads: int) -> Iterator[None]:
        """Exactly `threads` for the block, whatever the load (a check or a benchmark that
        compares counts); as before after it."""
        with self._lock:
            saved, self._pinned = self._pinned, threads
        try:
            yield
        finally:
            with self._lock:
                self._pinned = saved

    def describe(self) -> str:
        """For `/health` and `serve`'s banner: what the count follows, and why not."""
        if self.adapts:
            return f"up to {self.most}, following the cores other processes leave free"
        return f"{self.most}, fixed ({self.why_fixed})"

    @property
    def threads(self) -> int:
        """The count the engine computes on now."""
        if self._pinned is not None:
            return self._pinned
        return self._free if self.adapts else self.most

    def adjust(self) -> int:
        """Set torch's thread count on the calling thread (the one that computes; OpenMP
        keeps it per thread) to `threads`; the count."""
        threads = self.threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def _sample(self) -> None:
        """Every INTERVAL_S, the cores free over the last interval (others' busy time on the
        CPUs this process may use, less its own), within [1, most]."""
        last_at, last_busy, last_own = time.monotonic(), _busy_s(self._cpus), _own_s()
        while self.adapts:
            time.sleep(INTERVAL_S)
            now, busy, own = time.monotonic(), _busy_s(self._cpus), _own_s()
            others = min(len(self._cpus), max(0.0, (busy - last_busy) - (own - last_own))
                         / (now - last_at))
            # A core counts as taken once others keep it three-quarters busy: a light load
            # (a client's requests, an idle server) leaves the team whole.
            self._free = max(1, min(self.most, len(self._cpus) - int(others + 0.25)))
            last_at, last_busy, last_own = now, busy, own


_BUDGET: ThreadBudget | None = None
_BUDGET_LOCK = threading.Lock()


def engine_threads() -> ThreadBudget:
    """The process's budget (one per process: the machine's load is the same for every
    engine in it), made at its first use."""
    global _BUDGET
    with _BUDGET_LOCK:
        if _BUDGET is None:
            _BUDGET = ThreadBudget()
        return _BUDGET


def _allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return list(range(psutil.cpu_count() or 1))


def _busy_s(cpus: list[int]) -> float:
    """CPU seconds `cpus` have spent busy, every process's (time a hypervisor took, steal,
    counts as busy: that core was not ours either)."""
    per_cpu = psutil.cpu_times(percpu=True)
    total = 0.0
    for index in cpus:
        if index >= len(per_cpu):
            continue
        times = per_cpu[index]
        idle = sum(float(getattr(times, name, 0.0)) for name in ("idle", "iowait"))
        inside_user = sum(float(getattr(times, name, 0.0)) for name in ("guest", "guest_nice"))
        total += float(sum(times)) - idle - inside_user  # guest time is in user time too
    return total


def _own_s() -> float:
    """CPU seconds this process has spent (all its threads)."""
    times = os.times()
    return times.user + times.system
