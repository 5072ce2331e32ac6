"""The engine's thread count follows the cores other processes leave free (engine/threads.py),
and a prefill gives the same bits whatever the count."""

from __future__ import annotations

import time

import pytest
import torch

from kvtrace.bench.contend import contention
from kvtrace.engine import prefill
from kvtrace.engine.numerics import threads_are_invariant
from kvtrace.engine.threads import INTERVAL_S, THREADS_ENV, ThreadBudget, engine_threads


def _settle(budget: ThreadBudget, seconds: float) -> int:
    """Adjust as an engine does, every few milliseconds, for `seconds`; the last count."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        budget.adjust()
        time.sleep(0.02)
    return budget.adjust()


def test_a_busy_process_on_every_core_leaves_the_engine_one_thread():
    before = torch.get_num_threads()
    budget = ThreadBudget(most=2)
    try:
        with contention(len(budget._cpus)):  # one busy process per core: no core is free
            _settle(budget, 0.3)  # the processes start
            assert _settle(budget, 3 * INTERVAL_S) == 1
            assert torch.get_num_threads() == 1  # set on this thread, the one that computes
    finally:
        budget.hold("the test is over")  # its sampler thread stops
        torch.set_num_threads(before)


def test_a_fixed_count_is_kept_under_any_load(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "2")
    before = torch.get_num_threads()
    budget = ThreadBudget()
    try:
        assert not budget.adapts and budget.describe() == f"2, fixed ({THREADS_ENV}=2)"
        with contention(1):
            assert _settle(budget, 2 * INTERVAL_S) == 2
    finally:
        torch.set_num_threads(before)


def test_a_bad_fixed_count_is_refused(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "many")
    with pytest.raises(ValueError, match=f"{THREADS_ENV}='many': give a number of threads"):
        ThreadBudget()


def test_holding_stops_adapting_at_the_starting_count():
    budget = ThreadBudget(most=2)
    budget.hold("a reason")
    assert not budget.adapts and budget.threads == 2
    assert budget.describe() == "2, fixed (a reason)"


def test_prefill_gives_the_same_bits_on_one_thread_as_on_two(tiny_engine):
    """What lets the count change between a cold run and a cache hit: checked at load on the
    model's products (`threads_are_invariant`), here on a whole prefill."""
    assert threads_are_invariant(tiny_engine.model, 2)
    ids = [(i * 37) % 200 + 3 for i in range(300)]
    logits = []
    for threads in (2, 1):
        with engine_threads().pinned(threads):
            logits.append(prefill(tiny_engine, None, ids).logits.clone())
            assert torch.get_num_threads() == threads
    assert torch.equal(logits[0], logits[1])
