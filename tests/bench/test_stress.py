"""Concurrent and SIGKILLed writer processes on both backends (issue 11, item 1 and
"prove it"): every append a writer was promised is on its run exactly once, fsck is
clean, and no writer saw an error other than ConflictError.

Short settings here; `python -m kvtrace.bench.stress all URL` runs the long ones
(docs/reliability.md). Writers are real processes (kvtrace/bench/stress.py).
"""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

from kvtrace import RetryableError
from kvtrace.bench.stress import run_kills, run_writers, verify
from kvtrace.store.db.backend import MAX_ATTEMPTS, retried, write_transaction, writer


def test_writers_on_their_own_runs_lose_nothing(store_url):
    outcome = run_writers(store_url, num_writers=3, num_steps=30)
    assert verify(store_url, outcome) == []
    assert outcome.num_appends == 90 and outcome.num_conflicts == 0


def test_writers_on_one_run_conflict_but_lose_nothing(store_url):
    outcome = run_writers(store_url, num_writers=3, num_steps=20, shared_run=True)
    assert verify(store_url, outcome) == []
    assert outcome.num_appends == 60


def test_writers_sharing_blobs_in_opposite_orders_never_deadlock(store_url):
    # Writer A records ("X{i}", "Y{i}"), writer B ("Y{i}", "X{i}"), in lock step: on
    # PostgreSQL, inserting the blobs in payload order deadlocked 3-25 % of appends.
    outcome = run_writers(store_url, num_writers=2, num_steps=150, swap_blobs=True)
    assert verify(store_url, outcome) == []
    assert outcome.num_appends == 300


def test_sigkilled_writers_lose_no_promised_step(store_url):
    outcome = run_kills(store_url, num_rounds=3, num_writers=2, max_alive_s=0.4, seed=11)
    assert outcome.num_kills == 6 and outcome.num_appends >= 6
    assert verify(store_url, outcome) == []


def test_a_postgresql_deadlock_is_a_retryable_error(store_url, store):
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite writers queue (BEGIN IMMEDIATE): they cannot deadlock")
    engine = writer(store.engine)
    both_first = threading.Barrier(2, timeout=10)
    errors: list[BaseException] = []

    def insert(first: str, second: str) -> None:
        try:
            with write_transaction(engine) as conn:
                for key in (first, second):
                    conn.execute(
                        sa.text("INSERT INTO blobs (hash, size, data) VALUES (:h, 0, '')"),
                        {"h": bytes.fromhex(key * 64)},
                    )
                    if key == first:
                        both_first.wait()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=insert, args=pair) for pair in (("a", "b"), ("b", "a"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], RetryableError), errors
    assert "deadlock" in str(errors[0]) and "nothing was written" in str(errors[0])


def test_retried_calls_again_until_the_database_stops_aborting():
    calls = []

    @retried
    def flaky(fail_times: int) -> str:
        calls.append(1)
        if len(calls) <= fail_times:
            raise RetryableError("aborted")
        return "done"

    assert flaky(3) == "done" and len(calls) == 4
    calls.clear()
    with pytest.raises(RetryableError):
        flaky(MAX_ATTEMPTS)
    assert len(calls) == MAX_ATTEMPTS
