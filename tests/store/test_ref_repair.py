"""Refs are the one mutable table: fsck checks them against the reflog, and a ref
deleted or moved behind kvtrace's back is restored from it (issue 11, item 10).

Each test runs once per backend; `tamper` bypasses the database's guards on purpose.
"""

from __future__ import annotations

import pytest

from kvtrace.errors import RunNotFoundError, UsageError
from tests.conftest import tamper


def _run(store, name="main", n=3):
    run = store.run(name)
    return [run.record_tool_call("t", {"i": i}, i) for i in range(n)]


def test_a_sound_store_has_no_ref_problems(store):
    steps = _run(store)
    store.fork("main@1", "exp")
    store.revert("main", to="main@2")
    store.reset("main", to=steps[-1].id)
    assert store.fsck().problems == []


def test_fsck_reports_a_ref_moved_behind_kvtraces_back(store):
    steps = _run(store)
    tamper(store, "UPDATE refs SET head = :h WHERE name = 'main'",
           h=bytes.fromhex(steps[0].id))
    problems = store.fsck().problems
    assert len(problems) == 1 and "'main'" in problems[0] and "reflog" in problems[0]


def test_fsck_reports_a_deleted_ref_and_reset_restores_it(store):
    steps = _run(store)
    tamper(store, "DELETE FROM refs WHERE name = 'main'")
    with pytest.raises(RunNotFoundError):
        store.head("main")
    problems = store.fsck().problems
    assert len(problems) == 1 and "missing" in problems[0] and "kvtrace reset main" in problems[0]
    # The reflog still knows it, and says where it was.
    assert store.reflog("main")[0].new_head == steps[-1].id
    assert {e.ref for e in store.reflog()} == {"main"}
    restored = store.reset("main")
    assert restored.id == steps[-1].id and store.head("main").id == steps[-1].id
    assert store.fsck().problems == []
    assert store.reflog("main")[0].message.startswith("restore")


def test_reset_without_a_target_puts_a_moved_ref_back(store):
    steps = _run(store)
    tamper(store, "UPDATE refs SET head = :h WHERE name = 'main'",
           h=bytes.fromhex(steps[0].id))
    assert store.reset("main").id == steps[-1].id
    assert store.fsck().problems == []


def test_fsck_reports_a_ref_created_without_a_reflog(store):
    steps = _run(store)
    tamper(
        store,
        "INSERT INTO refs (name, head, created_at) VALUES ('sneaky', :h, 1.0)",
        h=bytes.fromhex(steps[0].id),
    )
    problems = store.fsck().problems
    assert problems == ["run 'sneaky' has no reflog: it was created behind kvtrace's back"]


def test_reset_of_a_run_that_never_existed_is_not_found(store):
    _run(store)
    with pytest.raises(RunNotFoundError):
        store.reset("nosuch")
    with pytest.raises(RunNotFoundError):
        store.reset("nosuch", to="main")


def test_reset_to_the_reflog_head_of_an_empty_run_needs_a_target(store):
    store.run("empty")
    with pytest.raises(UsageError, match="pass to=STEP"):
        store.reset("empty")
