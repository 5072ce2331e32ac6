"""When an engine thread trims its heap (kvtrace/engine/heap.py's HeapTrimmer)."""

from __future__ import annotations

import time

from kvtrace.engine.heap import HeapTrimmer


def test_nothing_is_owed_before_work_and_an_idle_wait_is_owed_after():
    trimmer = HeapTrimmer(idle_s=0.25, busy_s=60.0)
    assert trimmer.idle_wait() is None  # an idle thread with nothing done waits for work
    trimmer.worked()
    assert trimmer.num_trims == 0  # busy for less than busy_s: no trim between forwards
    assert trimmer.idle_wait() == 0.25
    trimmer.trim()
    assert trimmer.num_trims == 1
    assert trimmer.idle_wait() is None  # the trim paid what the work owed


def test_continuous_work_trims_every_busy_interval():
    trimmer = HeapTrimmer(idle_s=1.0, busy_s=0.0)
    for _ in range(3):
        trimmer.worked()
    assert trimmer.num_trims == 3
    assert trimmer.idle_wait() is None


def test_the_busy_interval_counts_from_the_first_work_after_a_trim():
    # a request after a long pause is not trimmed at its first forward
    trimmer = HeapTrimmer(idle_s=1.0, busy_s=0.2)
    time.sleep(0.3)
    trimmer.worked()
    assert trimmer.num_trims == 0
    time.sleep(0.3)
    trimmer.worked()  # busy for 0.3 s since its first work: trimmed
    assert trimmer.num_trims == 1
