"""Listing runs a page at a time, one run by name, the last moves of a run: on both backends."""

from __future__ import annotations

import pytest

from kvtrace.errors import RunNotFoundError, UsageError


def _runs(store, names):
    for name in names:
        store.run(name).record_tool_call("t", {"run": name}, 1)


def test_runs_come_a_page_at_a_time_after_the_last_name_seen(store):
    _runs(store, ["c", "a", "e", "b", "d"])
    first = store.runs(limit=2)
    assert [info.name for info in first] == ["a", "b"]
    second = store.runs(limit=2, after=first[-1].name)
    assert [info.name for info in second] == ["c", "d"]
    assert [info.name for info in store.runs(limit=2, after="d")] == ["e"]
    assert store.runs(limit=2, after="e") == []
    assert [info.name for info in store.runs()] == ["a", "b", "c", "d", "e"]
    assert all(info.depth == 1 for info in first + second)


def test_runs_with_a_prefix_are_exactly_those_whose_names_start_with_it(store):
    _runs(store, ["s/agent-1", "s/agent-2", "s/agents", "S/agent-3", "t"])
    assert [info.name for info in store.runs(prefix="s/agent-")] == ["s/agent-1", "s/agent-2"]


def test_run_info_describes_one_run_as_runs_lists_it(store):
    _runs(store, ["a", "b"])
    store.run("empty")
    assert store.run_info("b") == next(info for info in store.runs() if info.name == "b")
    assert store.run_info("empty").depth == 0 and store.run_info("empty").head_id is None
    assert store.has_run("empty") and not store.has_run("nope")
    with pytest.raises(RunNotFoundError):
        store.run_info("nope")


def test_reflog_limit_gives_the_newest_moves(store):
    run = store.run("main")
    for i in range(3):
        run.record_tool_call("t", {"i": i}, i)
    store.revert("main", to="main@1")
    moves = store.reflog("main")
    assert store.reflog("main", limit=1) == moves[:1] and moves[0].reason == "revert"
    assert store.reflog("main", limit=2) == moves[:2]
    with pytest.raises(UsageError):
        store.reflog("main", limit=0)
