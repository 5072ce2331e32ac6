"""Supervision: watch a run from another process, pause it, revert it, fork it with an edit.

Real parts on both backends: the writer is a separate Python process
appending over its own connection, so the watcher sees only what the
database delivers (SQLite: polling; PostgreSQL: LISTEN/NOTIFY).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from kvtrace import open_store
from kvtrace.errors import ConflictError, RunNotFoundError, RunPausedError, UsageError

WRITER = textwrap.dedent("""
    import sys, time
    from kvtrace import open_store
    store = open_store(sys.argv[1])
    run = store.run(sys.argv[2])
    time.sleep(0.5)  # let the watcher start
    for i in range(int(sys.argv[3])):
        run.record_tool_call("count", {"i": i}, i)
        time.sleep(0.01)
    store.revert(sys.argv[2], to=f"{sys.argv[2]}@2")
    run.refresh()
    run.record_note("after the revert")
""")


def test_a_watcher_sees_every_step_another_process_appends_in_order(store_url):
    store = open_store(store_url)
    store.run("live")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, store_url, "live", "20"])
    events = []
    try:
        for event in store.watch("live", timeout=60):
            events.append(event)
            if event.kind == "step" and event.step.kind == "note":
                break
    finally:
        writer.wait(timeout=60)
    steps = [e for e in events if e.kind == "step"]
    assert [s.step.content["arguments"]["i"] for s in steps[:-1]] == list(range(20))
    assert len({e.cursor for e in events}) == len(events)  # none twice
    moved = [e for e in events if e.kind == "moved"]
    assert len(moved) == 1 and moved[0].reason == "revert" and moved[0].is_back
    assert steps[-1].step.parent_id == moved[0].head  # the note went on from the new head
    store.close()


def test_watch_resumes_after_a_cursor_without_repeating(store):
    run = store.run("r")
    run.record_tool_call("t", {}, 1)
    first = next(e for e in store.watch("r", since=0, timeout=5) if e.kind == "step")
    run.record_tool_call("t", {}, 2)
    later = list(store.watch("r", since=first.cursor, timeout=0.3))
    assert [e.step.content["result"] for e in later if e.kind == "step"] == [2]


def test_a_watch_cursor_taken_now_lets_a_later_call_see_only_what_follows(store):
    run = store.run("c")
    assert store.watch_cursor("c") > 0  # the run's creation is its first entry
    run.record_tool_call("t", {}, 1)
    cursor = store.watch_cursor("c")
    assert cursor == store.reflog("c")[0].id
    run.record_tool_call("t", {}, 2)
    store.pause("c")
    later = list(store.watch("c", since=cursor, timeout=0))
    assert [e.kind for e in later] == ["step", "pause"]
    assert later[0].step.content["result"] == 2
    with pytest.raises(RunNotFoundError):
        store.watch_cursor("nobody")


def test_watching_an_unknown_run_fails_at_once(store):
    from kvtrace.errors import RunNotFoundError

    with pytest.raises(RunNotFoundError):
        store.watch("nobody")


def test_a_paused_run_refuses_appends_until_resumed(store):
    run = store.run("w")
    run.record_tool_call("t", {}, 1)
    store.pause("w", reason="checking a tool result")
    assert run.paused
    with pytest.raises(RunPausedError, match="checking a tool result"):
        run.record_tool_call("t", {}, 2)
    assert store.head("w").depth == 1  # nothing written
    store.resume("w")
    assert not run.paused
    assert run.record_tool_call("t", {}, 2).depth == 2
    reasons = [e.reason for e in store.reflog("w")]
    assert reasons[:3] == ["append", "resume", "pause"]
    with pytest.raises(UsageError):
        store.resume("w")  # not paused


def test_undo_skips_pause_and_resume(store):
    run = store.run("u")
    run.record_tool_call("t", {}, 1)
    run.record_tool_call("t", {}, 2)
    store.revert("u", to="u@1")
    store.pause("u")
    store.resume("u")
    assert store.undo("u").depth == 2  # undoes the revert


def test_a_reverted_worker_gets_a_conflict_and_loses_nothing(store):
    worker = store.run("job")
    for i in range(4):
        worker.record_tool_call("step", {"i": i}, i)
    bad = worker.head
    store.revert("job", to="job@2")  # a supervisor, through its own handle
    with pytest.raises(ConflictError):
        worker.record_tool_call("step", {"i": 4}, 4)
    worker.refresh()
    assert worker.record_tool_call("step", {"i": "again"}, 0).depth == 3
    reachable = {entry.old_head for entry in store.reflog("job")}
    assert bad.id in reachable  # the reverted steps stay reachable from the reflog
    assert store.show(bad.id).content["result"] == 3


def test_fork_with_an_edited_tool_result(store):
    run = store.run("a")
    run.record_model_call([{"role": "user", "content": "weather?"}],
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "c1", "type": "function",
                               "function": {"name": "weather", "arguments": "{}"}}]},
                          model="m")
    original = run.record_tool_call("weather", {}, "rain", call_id="c1")
    fork = store.fork("a@2", "a-fixed", edit={"result": "sun"})
    head = fork.head
    assert head.parent_id == original.parent_id and head.id != original.id
    assert head.content["result"] == "sun" and head.meta["edit_of"] == original.id
    assert head.meta["call_id"] == "c1" and head.meta["tool"] == "weather"
    assert store.head("a").id == original.id  # the original run is untouched
    assert store.reflog("a-fixed")[0].reason == "fork"
    assert fork.record_note("continues").parent_id == head.id


def test_fork_with_an_edited_model_call(store):
    run = store.run("m")
    first = run.record_model_call([{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hi"}], "hello", model="m")
    fork = store.fork("m@1", "m-edit", edit={"messages": [
        {"role": "system", "content": "be verbose"}, {"role": "user", "content": "hi"}]})
    edited = fork.head
    assert edited.parent_id is None and edited.kind == "model_call"
    assert edited.content["messages"][0]["content"] == "be verbose"
    assert edited.content["response"] == first.content["response"]
    assert store.fsck().is_ok


@pytest.mark.parametrize("edit", [{"nonsense": 1}, {}, {"response": {"role": "user"}}])
def test_a_bad_edit_is_refused_and_creates_no_run(store, edit):
    store.run("x").record_model_call([{"role": "user", "content": "q"}], "a", model="m")
    with pytest.raises(UsageError):
        store.fork("x", "x-edit", edit=edit)
    assert [r.name for r in store.runs()] == ["x"]


def test_watch_on_postgresql_wakes_on_notify_not_on_polling(store_url):
    store = open_store(store_url)
    if store.engine.dialect.name != "postgresql":
        store.close()
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    run = store.run("n")
    events = store.watch("n", timeout=30, poll_interval=20)  # polling alone would wait 20 s
    started = time.monotonic()
    writer = subprocess.Popen([sys.executable, "-c",
                               "import sys; from kvtrace import open_store; "
                               "open_store(sys.argv[1]).run('n').record_tool_call('t', {}, 1)",
                               store_url])
    event = next(events)
    writer.wait(timeout=60)
    assert event.kind == "step" and time.monotonic() - started < 15
    del run
    store.close()


def test_a_watch_starts_when_it_is_called_not_when_first_read(store):
    store.run("w").record_tool_call("t", {}, 0)
    events = store.watch("w", timeout=0.5)  # set up, then the worker starts
    store.run("w").record_tool_call("t", {}, 1)
    assert [e.step.content["result"] for e in events if e.kind == "step"] == [1]


def test_an_edited_fork_drops_the_originals_measurements_and_may_add_tools(store):
    run = store.run("u")
    run.record_model_call([{"role": "user", "content": "q"}], "a", model="m",
                          usage={"prompt_tokens": 9, "cached_tokens": 4}, timings={"s": 1.0})
    tools = [{"type": "function", "function": {"name": "f"}}]
    head = store.fork("u", "u-edit", edit={"tools": tools}).head
    assert head.content["tools"] == tools and head.meta["model"] == "m"
    assert "usage" not in head.meta and "timings" not in head.meta


def test_a_batch_is_its_threads_alone(store):
    import threading

    results: list[int] = []
    with store.batch():
        store.run("mine").record_tool_call("t", {}, 1)
        worker = threading.Thread(target=lambda: results.append(
            store.run("theirs").record_tool_call("t", {}, 2).depth))
        worker.start()
        worker.join(timeout=0.5)  # blocked on the write lock, not writing through the batch
        assert results == [] or store.engine.dialect.name == "postgresql"
    worker.join(timeout=30)
    assert results == [1]
    assert {r.name for r in store.runs()} == {"mine", "theirs"}
