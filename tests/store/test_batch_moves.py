"""A batch's appends move their run once when the batch is done (store/objects/batched.py), with
every guarantee of a move one append at a time: on both backends."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from kvtrace import ConflictError, open_store
from kvtrace.errors import RunPausedError


def _count(store, table: str) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def test_a_batch_logs_one_entry_per_run_from_where_it_found_it(store):
    run = store.run("main")
    before = run.record_tool_call("t", {"i": 0}, 0)
    with store.batch():
        steps = [run.record_tool_call("t", {"i": i}, i) for i in range(1, 6)]
        other = store.run("other")
        other.record_tool_call("t", {"other": True}, 1)
    last = store.reflog("main")[0]
    assert (last.reason, last.old_head, last.new_head) == ("batch", before.id, steps[-1].id)
    assert last.message == "5 steps appended in one batch: 5 tool_call"
    assert [e.reason for e in reversed(store.reflog("main"))] == ["create", "append", "batch"]
    assert [s.id for s in store.log("main")] == [s.id for s in reversed(steps)] + [before.id]
    assert store.head("main").id == steps[-1].id and store.head("other").depth == 1
    assert store.fsck().is_ok


def test_undo_of_a_batch_moves_the_run_back_to_where_the_batch_found_it(store):
    run = store.run("main")
    before = run.record_tool_call("t", {"i": 0}, 0)
    with store.batch():
        for i in range(1, 4):
            run.record_tool_call("t", {"i": i}, i)
    undone = store.undo("main")
    assert undone is not None and undone.id == before.id == store.head("main").id
    assert [e.reason for e in store.reflog("main")][:2] == ["reset", "batch"]
    store.undo("main")  # the undo is itself undone: the batch's steps are all back
    assert store.head("main").depth == 4 and store.fsck().is_ok


def test_undo_of_an_imported_run_leaves_it_empty(store):
    from kvtrace.formats import import_document

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "done"}]
    info = import_document(store, {"messages": messages}, format="openai", run="imported")
    assert [e.reason for e in reversed(store.reflog("imported"))] == ["create", "batch"]
    assert store.undo("imported") is None and store.run_info("imported").head_id is None
    store.undo("imported")
    assert store.run_info("imported").head_id == info.head_id


def test_a_write_inside_a_batch_sees_the_heads_its_appends_left(store):
    run = store.run("main")
    with store.batch():
        run.record_tool_call("t", {"i": 1}, 1)
        last = run.record_tool_call("t", {"i": 2}, 2)
        fork = store.fork("main", "side")  # made after the appends' moves
        fork.record_tool_call("t", {"side": True}, 3)
        run.record_tool_call("t", {"i": 3}, 4)
    assert store.resolve("side@2") == last.id and store.head("side").depth == 3
    assert store.head("main").depth == 3
    # the fork flushed the first two appends' move: one entry, and one for the third
    assert [e.reason for e in reversed(store.reflog("main"))] == ["create", "batch", "batch"]


def test_a_batch_on_a_paused_run_writes_nothing(store):
    run = store.run("main")
    run.record_tool_call("t", {"i": 0}, 0)
    store.pause("main", reason="a supervisor looks")
    steps, moves = _count(store, "steps"), len(store.reflog("main"))
    with pytest.raises(RunPausedError), store.batch():
        run.record_tool_call("t", {"i": 1}, 1)
        run.record_tool_call("t", {"i": 2}, 2)
    assert (_count(store, "steps"), len(store.reflog("main"))) == (steps, moves)
    assert store.head("main").depth == 1


def test_a_batch_on_a_run_moved_meanwhile_writes_nothing(store_url):
    store, elsewhere = open_store(store_url), open_store(store_url)
    try:
        run = store.run("main")
        run.record_tool_call("t", {"i": 0}, 0)
        elsewhere.run("main").record_tool_call("t", {"elsewhere": True}, 1)  # run is stale now
        steps = _count(store, "steps")
        with pytest.raises(ConflictError), store.batch():
            run.record_tool_call("t", {"i": 1}, 1)
            run.record_tool_call("t", {"i": 2}, 2)
        assert _count(store, "steps") == steps
        assert store.head("main").content["arguments"] == {"elsewhere": True}
    finally:
        store.close()
        elsewhere.close()


def test_a_batch_moves_each_run_with_one_swap(tmp_path):
    """SQLite's trace of the statements run: one UPDATE of a run's ref for ten appends."""
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    statements: list[str] = []

    def on_connect(dbapi, _record) -> None:
        dbapi.set_trace_callback(statements.append)

    sa.event.listen(store.engine, "connect", on_connect)
    store.engine.dispose()
    try:
        run = store.run("main")
        with store.batch():
            for i in range(10):
                run.record_tool_call("t", {"i": i}, i)
        swaps = [s for s in statements if s.startswith("UPDATE refs")]
        assert len(swaps) == 1 and store.head("main").depth == 10
        assert [e.reason for e in store.reflog("main")] == ["batch", "create"]
    finally:
        store.close()
