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

So `ThreadBudget.adjust`, called before each prefill and decode step, looks
at most every `INTERVAL_S` at how busy the machine was since its last look,
less this process's own time (psutil's system-wide CPU times; `os.times`),
and runs on the cores left free: at least one, at most the count torch
started with (the user's `OMP_NUM_THREADS`, else one per core). A machine
whose other processes come and go gets the team back within a second.

Fidelity: a cache hit must give the bits a cold run gives, and the cold run
may have run on another thread count. `load_engine` checks that the model's
matrix products give the same bits on one thread as on all
(`threads_are_invariant`, next to the row check in numerics.py); where they
do not, the budget stays fixed at the starting count. `KVTRACE_THREADS=N`
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
            f"{THREADS_ENV}={fixed}" if fixed is not None else "one thread")
        self._cores = _cores()
        self._lock = threading.Lock()
        self._threads = self.most
        self._last_at = time.monotonic()
        self._last_busy, self._last_own = _busy_s(), _own_s()

    def hold(self, why: str) -> None:
        """Stop adapting: compute on the starting count from now on, because of `why`."""
        with self._lock:
            self.adapts, self._threads = False, self.most
            self.why_fixed = self.why_fixed or why

    @contextmanager
    def pinned(self, threads: int) -> Iterator[None]:
        """Exactly `threads` for the block, whatever the load (a check or a benchmark that
        compares counts); adapting again after it."""
        with self._lock:
            saved = (self.adapts, self.most, self._threads)
            self.adapts, self.most, self._threads = False, threads, threads
        try:
            yield
        finally:
            with self._lock:
                self.adapts, self.most, self._threads = saved

    def describe(self) -> str:
        """For `/health` and `serve`'s banner: what the count follows, and why not."""
        if self.adapts:
            return f"up to {self.most}, following the cores other processes leave free"
        return f"{self.most}, fixed ({self.why_fixed})"

    @property
    def threads(self) -> int:
        """The count the engine computes on now."""
        return self._threads

    def adjust(self) -> int:
        """Set torch's thread count (on the calling thread, the one that computes) to the cores
        free since the last look, at most every INTERVAL_S; the count."""
        if self.adapts:
            now = time.monotonic()
            with self._lock:
                elapsed = now - self._last_at
                if elapsed >= INTERVAL_S:
                    busy, own = _busy_s(), _own_s()
                    others = max(0.0, (busy - self._last_busy) - (own - self._last_own))
                    free = self._cores - others / elapsed
                    self._threads = max(1, min(self.most, round(free)))
                    self._last_at, self._last_busy, self._last_own = now, busy, own
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        return self._threads


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


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy (every process, every core; time a
    hypervisor took, steal, counts as busy: that core was not ours either)."""
    times = psutil.cpu_times()
    idle = sum(float(getattr(times, name, 0.0)) for name in ("idle", "iowait"))
    inside_user = sum(float(getattr(times, name, 0.0)) for name in ("guest", "guest_nice"))
    return float(sum(times)) - idle - inside_user  # guest time is counted in user time too


def _own_s() -> float:
    """CPU seconds this process has spent (all its threads)."""
    times = os.times()
    return times.user + times.system
