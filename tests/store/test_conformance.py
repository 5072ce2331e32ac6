"""One conformance suite for every store backend (SQLite file and PostgreSQL).

Each test runs once per backend through the `store` fixture (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sqlite3
import threading

import pytest
import sqlalchemy as sa

from kvtrace import ConflictError, IntegrityError, open_store
from kvtrace.errors import (
    InvalidNameError,
    RunNotFoundError,
    StepNotFoundError,
    StoreError,
    UsageError,
)
from kvtrace.store.objects.encoding import step_body
from tests.conftest import tamper

MSGS = [{"role": "user", "content": "What is 2+2?"}]
REPLY = {"role": "assistant", "content": "4"}


def _linear(store, name="main", n=5):
    run = store.run(name)
    return run, [run.record_tool_call("t", {"i": i}, i * i) for i in range(n)]


def _count(store, table):
    with store.engine.connect() as conn:
        return conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar()


# -- ids --------------------------------------------------------------------------


def test_identical_content_under_same_parent_is_the_same_step(store):
    a = store.run("a").record_model_call(MSGS, REPLY, model="m")
    b = store.run("b").record_model_call(MSGS, REPLY, model="m")
    assert a.id == b.id
    assert _count(store, "steps") == 1


def test_changed_content_or_parent_changes_the_id(store):
    run = store.run("main")
    first = run.record_model_call(MSGS, REPLY, model="m")
    again = run.record_model_call(MSGS, REPLY, model="m")  # same content, new parent
    other = store.run("other").record_model_call(
        MSGS, {"role": "assistant", "content": "5"}, model="m"
    )
    assert len({first.id, again.id, other.id}) == 3
    assert again.parent_id == first.id and again.depth == 2


def test_blobs_are_stored_once_however_often_referenced(store):
    run = store.run("main")
    for _ in range(3):
        run.record_tool_call("t", {"same": True}, "same result")
    assert _count(store, "steps") == 3
    assert _count(store, "blobs") == 2


def test_step_content_round_trips(store):
    run = store.run("main")
    step = run.record_model_call(
        MSGS,
        REPLY,
        model="m",
        params={"temperature": 0},
        usage={"prompt_tokens": 7},
        timings={"total_s": 0.5},
    )
    shown = store.show(step.id)
    assert shown.content == {"messages": MSGS, "response": REPLY}
    assert shown.meta == {
        "model": "m",
        "params": {"temperature": 0},
        "usage": {"prompt_tokens": 7},
        "timings": {"total_s": 0.5},
    }
    raw = run.record("http", {"url": "http://x/"}, raw={"body": b"\x00\xff"})
    assert store.show(raw.id).content == {"url": "http://x/", "body": b"\x00\xff"}


# -- addressing -------------------------------------------------------------------


def test_step_addresses_resolve(store):
    _, steps = _linear(store, n=5)
    assert store.resolve("main") == steps[-1].id
    assert store.resolve("main@1") == steps[0].id
    assert store.resolve("main@5") == steps[4].id
    assert store.resolve("main~2") == steps[2].id
    assert store.resolve(steps[1].id[:9]) == steps[1].id


def test_addresses_are_kept_as_their_32_raw_bytes(store):
    _, steps = _linear(store, n=2)  # appends: the driver's own statements (backend.Prepared)
    with store.batch():  # a batch: one insert of many rows (PostgreSQL: unnest)
        batched = store.run("b").record_tool_call("t", {"i": 9}, 81)
    store.note(steps[1].id, "n")
    raw = {step.id: bytes.fromhex(step.id) for step in (*steps, batched)}
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, parent_id FROM steps")).all()
        heads = conn.execute(sa.text("SELECT head FROM refs ORDER BY name")).scalars().all()
        logged = conn.execute(sa.text("SELECT new_head FROM reflog ORDER BY id")).scalars().all()
        noted = conn.execute(sa.text("SELECT step_id FROM notes")).scalars().all()
        hashes = conn.execute(sa.text("SELECT hash FROM blobs")).scalars().all()
    assert {bytes(i): p and bytes(p) for i, p in rows} == {
        raw[steps[0].id]: None, raw[steps[1].id]: raw[steps[0].id], raw[batched.id]: None}
    assert [bytes(h) for h in heads] == [raw[batched.id], raw[steps[1].id]]
    assert [bytes(h) for h in logged if h is not None] == [
        raw[steps[0].id], raw[steps[1].id], raw[batched.id]]
    assert [bytes(n) for n in noted] == [raw[steps[1].id]]
    assert {bytes(h) for h in hashes} == {
        bytes.fromhex(a) for step in (*steps, batched) for a in step.payload.values()}


@pytest.mark.parametrize("spell", [str.upper, lambda a: a[:-1], lambda a: " ".join(a), repr])
def test_an_address_not_in_lowercase_hex_names_nothing(store, spell):
    step = store.run("main").record_tool_call("t", {}, 1)
    store.note(step.id, "n")
    with pytest.raises(StepNotFoundError):
        store.read_blob(spell(step.payload["result"]))
    assert store.notes_on([spell(step.id)]) == {}


def test_an_id_prefix_of_any_length_names_its_step(store):
    _, steps = _linear(store, n=3)
    for step in steps:
        assert {store.resolve(step.id[:length]) for length in range(7, 65)} == {step.id}
    with pytest.raises(StepNotFoundError):
        store.resolve(steps[0].id + "0")  # longer than any id


def test_an_odd_id_prefix_covers_both_halves_of_its_last_byte(store):
    # Ids are kept as raw bytes: "abcdef0" is a range over the byte 0x0? after "abcdef".
    ids = ["abcdef01" + "0" * 56, "abcdef0f" + "f" * 56, "abcdef10" + "0" * 56]
    for step_id in ids:  # rows planted by SQL: resolving reads ids, not bodies
        tamper(store, "INSERT INTO steps (id, parent_id, kind, depth, body, recorded_at) "
               "VALUES (:i, NULL, 'note', 1, :b, 1.0)", i=bytes.fromhex(step_id), b=b"{}")
    with pytest.raises(StepNotFoundError, match="ambiguous"):
        store.resolve("abcdef0")
    assert [store.resolve(p) for p in ("abcdef01", "abcdef0f", "abcdef1")] == ids


@pytest.mark.parametrize("spec", ["main@6", "main~5", "nosuchrun", "deadbeef00"])
def test_addresses_outside_the_store_are_clear_errors(store, spec):
    _linear(store, n=5)
    with pytest.raises((StepNotFoundError, RunNotFoundError)):
        store.resolve(spec)


def test_bad_run_name_is_refused_and_changes_nothing(store):
    with pytest.raises(InvalidNameError):
        store.run("no spaces please")
    assert store.runs() == []


def test_log_yields_head_first(store):
    _, steps = _linear(store, n=4)
    assert [s.id for s in store.log("main")] == [s.id for s in reversed(steps)]
    assert [s.depth for s in store.log("main", limit=2)] == [4, 3]
    assert [s.id for s in store.path("main")] == [s.id for s in steps]


# -- fork, revert, reset ----------------------------------------------------------


def test_fork_adds_one_ref_and_copies_nothing(store):
    _, steps = _linear(store, n=5)
    before = _count(store, "steps"), _count(store, "blobs")
    fork = store.fork("main@3", "exp")
    assert fork.head.id == steps[2].id
    assert (_count(store, "steps"), _count(store, "blobs")) == before
    assert _count(store, "refs") == 2
    child = fork.record_tool_call("t", {"edited": True}, "x")
    assert child.parent_id == steps[2].id
    assert store.resolve("main") == steps[-1].id


def test_fork_to_an_existing_name_conflicts(store):
    _linear(store, n=2)
    with pytest.raises(ConflictError):
        store.fork("main@1", "main")


def test_revert_keeps_reverted_steps_in_reflog(store):
    _, steps = _linear(store, n=5)
    store.revert("main", to="main@2")
    assert store.resolve("main") == steps[1].id
    last = store.reflog("main")[0]
    assert (last.reason, last.old_head, last.new_head) == ("revert", steps[-1].id, steps[1].id)
    assert store.show(steps[-1].id).id == steps[-1].id  # still reachable


def test_reset_to_reverted_head_undoes_the_revert(store):
    _, steps = _linear(store, n=5)
    store.revert("main", to="main@2")
    store.reset("main", to=steps[-1].id)
    assert [s.id for s in store.log("main")] == [s.id for s in reversed(steps)]


def test_undo_reverses_the_last_move(store):
    _, steps = _linear(store, n=3)
    store.revert("main", to="main@1")
    store.undo("main")
    assert store.resolve("main") == steps[-1].id
    assert [e.reason for e in store.reflog("main")][:2] == ["reset", "revert"]


def test_revert_to_a_step_outside_the_run_is_refused(store):
    _linear(store, n=3)
    other = store.run("other").record_tool_call("t", {}, "other")
    with pytest.raises(UsageError):
        store.revert("main", to=other.id)
    with pytest.raises(UsageError):
        store.revert("main", to="main")  # not an earlier step
    assert store.show("main").depth == 3


# -- writers ----------------------------------------------------------------------


def test_stale_writer_gets_a_conflict_and_writes_nothing(store):
    first = store.run("main")
    second = store.run("main")
    first.record_tool_call("t", {}, 1)
    steps_before = _count(store, "steps")
    with pytest.raises(ConflictError):
        second.record_tool_call("t", {}, 2)
    assert _count(store, "steps") == steps_before
    second.refresh()
    assert second.record_tool_call("t", {}, 2).depth == 2


def test_concurrent_appends_never_lose_a_step(store_url):
    landed: list[str] = []
    conflicts = [0]
    lock = threading.Lock()

    def writer(worker: int) -> None:
        store = open_store(store_url)
        run = store.run("shared")
        for i in range(15):
            while True:
                try:
                    step = run.record_tool_call("t", {"w": worker, "i": i}, None)
                except ConflictError:
                    with lock:
                        conflicts[0] += 1
                    run.refresh()
                    continue
                with lock:
                    landed.append(step.id)
                break
        store.close()

    open_store(store_url).run("shared")
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = open_store(store_url)
    chain = [s.id for s in store.log("shared")]
    assert sorted(chain) == sorted(landed)
    assert len(chain) == 60
    appends = [e for e in store.reflog("shared") if e.reason == "append"]
    assert len(appends) == 60
    store.close()


# -- notes ------------------------------------------------------------------------


def test_notes_annotate_without_changing_the_step(store):
    _, steps = _linear(store, n=2)
    store.note("main@1", "suspicious result", author="supervisor")
    (note,) = store.notes(steps[0].id)
    assert (note.text, note.author) == ("suspicious result", "supervisor")
    assert store.resolve("main") == steps[-1].id
    assert store.fsck().is_ok


def test_notes_on_many_steps_are_each_steps_notes_in_order(store, monkeypatch):
    from kvtrace.store import notes

    monkeypatch.setattr(notes, "_CHUNK", 2)  # several chunks of ids
    _, steps = _linear(store, n=5)
    store.note("main@1", "first")
    store.note("main@4", "a")
    store.note("main@1", "second", author="me")
    found = store.notes_on([s.id for s in steps])
    assert set(found) == {steps[0].id, steps[3].id}
    assert [n.text for n in found[steps[0].id]] == ["first", "second"]
    assert found[steps[0].id] == store.notes(steps[0].id)
    assert store.notes_on([]) == {}


# -- fsck -------------------------------------------------------------------------


def test_fsck_is_clean_on_a_sound_store(store):
    _linear(store, n=3)
    report = store.fsck()
    assert report.problems == [] and report.num_steps == 3


def test_fsck_detects_a_tampered_blob(store):
    _, steps = _linear(store, n=2)
    address = steps[0].payload["result"]
    tamper(store, "UPDATE blobs SET data = :d WHERE hash = :h", d=b"99", h=bytes.fromhex(address))
    assert any("does not hash" in p for p in store.fsck().problems)


def test_fsck_detects_a_tampered_step(store):
    _, steps = _linear(store, n=2)
    body = bytes(steps[1].id, "ascii")  # any other bytes
    tamper(store, "UPDATE steps SET body = :b WHERE id = :i", b=body, i=bytes.fromhex(steps[1].id))
    assert any(steps[1].id[:12] in p and "tampered" in p for p in store.fsck().problems)


def test_fsck_detects_a_missing_parent(store):
    _, steps = _linear(store, n=3)
    tamper(store, "DELETE FROM steps WHERE id = :i", i=bytes.fromhex(steps[0].id))
    assert any("parent" in p and "missing" in p for p in store.fsck().problems)


# -- append-only ------------------------------------------------------------------


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE steps SET kind = 'x'",
        "DELETE FROM steps",
        "UPDATE blobs SET size = 0",
        "DELETE FROM blobs",
        "UPDATE reflog SET reason = 'x'",
        "DELETE FROM reflog",
        "UPDATE notes SET text = 'x'",
        "DELETE FROM notes",
    ],
)
def test_plain_sql_cannot_update_or_delete_history(store, sql):
    _linear(store, n=2)
    store.note("main", "n")
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), store.engine.begin() as conn:
        conn.execute(sa.text(sql))
    assert store.fsck().is_ok and _count(store, "notes") == 1


# -- bundles ----------------------------------------------------------------------


def _bundle(store, name="main") -> bytes:
    buf = io.BytesIO()
    store.export_run(name, buf)
    return buf.getvalue()


def test_export_import_round_trip_keeps_ids(store, tmp_path):
    run, _ = _linear(store, n=4)
    run.record_model_call(MSGS, REPLY, model="m")
    run.record("http", {"url": "u"}, raw={"body": b"\x01\x02"})
    store.note("main@2", "keep me")
    data = _bundle(store)
    other = open_store(f"sqlite:///{tmp_path / 'other.db'}")
    info = other.import_bundle(io.BytesIO(data))
    assert info.head_id == store.resolve("main")
    assert [s.id for s in other.log("main")] == [s.id for s in store.log("main")]
    assert [n.text for n in other.notes("main@2")] == ["keep me"]
    assert other.fsck().is_ok
    other.close()


def test_import_into_the_same_store_under_a_new_name(store):
    _linear(store, n=3)
    info = store.import_bundle(io.BytesIO(_bundle(store)), name="copy")
    assert info.head_id == store.resolve("main")
    assert _count(store, "steps") == 3


def test_modified_bundle_is_refused_and_changes_nothing(store, tmp_path):
    _linear(store, n=3)
    lines = _bundle(store).decode().splitlines()
    for index, line in enumerate(lines):
        item = json.loads(line)
        if "step" in item:
            item["body"] = item["body"].replace('"tool":"t"', '"tool":"T"')
            lines[index] = json.dumps(item)
            break
    other = open_store(f"sqlite:///{tmp_path / 'other.db'}")
    with pytest.raises(IntegrityError):
        other.import_bundle(io.BytesIO("\n".join(lines).encode()))
    assert other.runs() == [] and _count(other, "steps") == 0
    other.close()


def test_garbage_is_not_a_bundle(store):
    with pytest.raises(UsageError):
        store.import_bundle(io.BytesIO(b"hello"))


# -- schema -----------------------------------------------------------------------


def test_reopening_keeps_everything(store_url):
    first = open_store(store_url)
    _, steps = _linear(first, n=2)
    first.close()
    again = open_store(store_url)
    assert again.resolve("main") == steps[-1].id
    again.close()


def test_bad_url_is_a_clear_error():
    with pytest.raises(StoreError):
        open_store("mysql+nosuchdriver://x/y")


# -- divergence -------------------------------------------------------------------


def test_diverge_finds_where_two_runs_part(store):
    _, steps = _linear(store, n=4)
    fork = store.fork("main@2", "exp")
    edited = fork.record_tool_call("t", {"edited": True}, "x")
    result = store.diverge("main", "exp")
    assert result.common is not None and result.common.id == steps[1].id
    assert result.first_a is not None and result.first_a.id == steps[2].id
    assert result.first_b is not None and result.first_b.id == edited.id
    assert (result.num_only_a, result.num_only_b) == (2, 1)


def test_graph_names_the_runs_that_branch_off(store):
    _linear(store, n=30)  # deep enough for skip pointers to matter
    for name, at in (("a", 3), ("b", 3), ("c", 20)):
        store.fork(f"main@{at}", name).record_tool_call("t", {"run": name}, name)
    store.fork("a", "a2").record_note("deeper on a")  # a2 takes a's branch too
    rows = {row.step.depth: row for row in store.graph("main")}
    assert (rows[3].num_branches, rows[3].branch_runs) == (2, ["a", "a2", "b"])
    assert (rows[20].num_branches, rows[20].branch_runs) == (1, ["c"])
    assert rows[30].heads == ["main"] and rows[30].num_branches == 0
    assert sum(row.num_branches for row in rows.values()) == 3
    store.fork("c", "c-copy")  # two runs at one head
    rows = {row.step.depth: row for row in store.graph("main", limit=12)}  # depths 19..30
    assert sorted(rows) == list(range(19, 31))
    assert rows[20].branch_runs == ["c", "c-copy"]
    assert all(row.branch_runs == [] for d, row in rows.items() if d != 20)  # a, b leave lower


def test_graph_counts_but_does_not_name_runs_past_the_cap(store, monkeypatch):
    from kvtrace.store.objects import graph

    _linear(store, n=6)
    for name in ("a", "b"):
        store.fork("main@3", name).record_tool_call("t", {"run": name}, name)
    monkeypatch.setattr(graph, "MAX_RUNS_TO_NAME", 1)
    rows = {row.step.depth: row for row in store.graph("main")}
    assert (rows[3].num_branches, rows[3].branch_runs) == (2, None)


def test_diverge_of_unrelated_runs_has_no_common_step(store):
    _linear(store, n=2)
    store.run("other").record_tool_call("t", {}, "other")
    result = store.diverge("main", "other")
    assert result.common is None and (result.num_only_a, result.num_only_b) == (2, 1)


# -- review findings: races, bundles, skip pointers ---------------------------------


def _run_threads(count, target):
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []
    results: list[object] = []

    def body(index):
        barrier.wait()
        try:
            results.append(target(index))
        except BaseException as exc:  # collected and asserted on by the caller
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def test_concurrent_creators_of_one_run_all_continue_it(store_url):
    open_store(store_url).close()

    def create(_):
        store = open_store(store_url)
        try:
            return store.run("shared").name
        finally:
            store.close()

    results, errors = _run_threads(4, create)
    assert errors == [] and results == ["shared"] * 4


def test_concurrent_forks_to_one_name_give_one_winner_and_conflicts(store):
    _linear(store, n=2)
    url = store.url

    def fork(_):
        other = open_store(url)
        try:
            return other.fork("main@1", "newfork").name
        finally:
            other.close()

    results, errors = _run_threads(4, fork)
    assert results == ["newfork"]
    assert len(errors) == 3 and all(isinstance(e, ConflictError) for e in errors)


def test_concurrent_openers_of_a_new_store_all_succeed(store_url):
    def opener(_):
        store = open_store(store_url)
        store.close()
        return True

    results, errors = _run_threads(4, opener)
    assert errors == [] and results == [True] * 4


def test_fsck_sees_one_snapshot_while_someone_writes(store):
    _linear(store, n=3)
    stop = threading.Event()

    def write():
        writer_store = open_store(store.url)
        writer_run = writer_store.run("writer")
        i = 0
        while not stop.is_set():
            writer_run.record_tool_call("t", {"w": i}, i)
            i += 1
        writer_store.close()

    thread = threading.Thread(target=write)
    thread.start()
    try:
        reports = [store.fsck() for _ in range(5)]
    finally:
        stop.set()
        thread.join()
    assert all(r.problems == [] for r in reports)


def test_concurrent_appends_do_conflict(store_url):
    open_store(store_url).run("race").record_tool_call("t", {}, 0)
    stores = [open_store(store_url) for _ in range(4)]
    runs = [s.run("race") for s in stores]  # every writer has seen the same head

    def append(index):
        return runs[index].record_tool_call("t", {"who": index}, index).id

    results, errors = _run_threads(4, append)
    for s in stores:
        s.close()
    assert len(results) == 1 and len(errors) == 3
    assert all(isinstance(e, ConflictError) for e in errors)
    assert open_store(store_url).show("race").id == results[0]


def test_import_into_another_store_of_the_same_backend(store, store_urls):
    _linear(store, n=3)
    other = open_store(store_urls())
    info = other.import_bundle(io.BytesIO(_bundle(store)))
    assert [s.id for s in other.log("main")] == [s.id for s in store.log("main")]
    assert info.depth == 3 and other.fsck().is_ok
    other.close()


def test_bundle_steps_in_any_order_get_true_depths(store, store_urls):
    _linear(store, n=6)
    lines = _bundle(store).decode().splitlines()
    header, rest = lines[0], lines[1:]
    shuffled = "\n".join([header, *reversed(rest)]).encode()
    other = open_store(store_urls())
    other.import_bundle(io.BytesIO(shuffled))
    assert [s.depth for s in other.log("main")] == [6, 5, 4, 3, 2, 1]
    assert other.resolve("main@2") == store.resolve("main@2")
    assert other.fsck().is_ok
    other.close()


@pytest.mark.parametrize(
    "mangle",
    [
        lambda lines: ['{"format": "kvtrace-bundle", "version": 1, "run": "x"}', *lines[1:]],
        lambda lines: ["[1, 2]", *lines[1:]],
        lambda lines: [lines[0], "42", *lines[1:]],
        lambda lines: [lines[0], '{"blob": "ab"}', *lines[1:]],
        lambda lines: [lines[0], '{"mystery": 1}', *lines[1:]],
        lambda lines: [lines[0], *lines[1:], '{"note": "x", "created_at": 1}'],
    ],
)
def test_malformed_bundles_are_clear_errors_and_change_nothing(store, store_urls, mangle):
    _linear(store, n=2)
    lines = mangle(_bundle(store).decode().splitlines())
    other = open_store(store_urls())
    with pytest.raises((UsageError, IntegrityError)):
        other.import_bundle(io.BytesIO("\n".join(lines).encode()))
    assert other.runs() == [] and _count(other, "steps") == 0
    other.close()


def test_step_at_any_depth_resolves_through_skip_pointers(store):
    _, steps = _linear(store, n=70)
    for number in (1, 2, 3, 17, 33, 64, 69, 70):
        assert store.resolve(f"main@{number}") == steps[number - 1].id
    assert store.resolve("main~69") == steps[0].id
    store.revert("main", to="main@5")
    assert store.resolve("main") == steps[4].id


def test_fsck_detects_a_wrong_skip_pointer(store):
    _, steps = _linear(store, n=8)
    # depth 8 skips to depth 2; point it at depth 3 instead
    tamper(store, "UPDATE steps SET skip_id = :s WHERE id = :i",
           s=bytes.fromhex(steps[2].id), i=bytes.fromhex(steps[7].id))
    assert any("skip pointer" in p for p in store.fsck().problems)


def test_fsck_detects_a_depth_that_does_not_count_from_the_root(store):
    _, steps = _linear(store, n=3)
    tamper(store, "UPDATE steps SET depth = 7 WHERE id = :i", i=bytes.fromhex(steps[1].id))
    problems = store.fsck().problems
    assert any(steps[1].id[:12] in p and "parent's depth + 1" in p for p in problems)


def test_fsck_stops_at_a_skip_pointer_that_points_down_its_own_run(store):
    _, steps = _linear(store, n=6)
    # depth 4 skips to depth 2; pointed at its child, depth 6's walk would go round for ever
    tamper(store, "UPDATE steps SET skip_id = :s WHERE id = :i",
           s=bytes.fromhex(steps[4].id), i=bytes.fromhex(steps[3].id))
    problems = store.fsck().problems
    assert problems == [f"step {steps[3].id[:12]}: skip pointer is wrong"]


def test_fsck_detects_a_run_whose_head_is_missing(store):
    _linear(store, n=2)
    tamper(store, "UPDATE refs SET head = :h WHERE name = 'main'", h=b"\xff" * 32)
    assert f"run 'main': head {'f' * 12} is missing" in store.fsck().problems


def test_fsck_detects_a_reflog_entry_whose_step_is_missing(store):
    _linear(store, n=2)
    first = store.reflog("main")[-1]
    tamper(store, "UPDATE reflog SET new_head = :h WHERE id = :i", h=b"\xee" * 32, i=first.id)
    assert f"reflog entry {first.id}: step {'e' * 12} is missing" in store.fsck().problems


def test_fsck_detects_a_note_whose_step_is_missing(store):
    _linear(store, n=2)
    insert = "INSERT INTO notes (step_id, author, text, created_at) VALUES (?, NULL, 'x', 1.0)"
    if store.engine.dialect.name == "sqlite":  # past the foreign key, which both enforce
        with contextlib.closing(sqlite3.connect(store.engine.url.database)) as conn, conn:
            conn.execute(insert, (b"\xdd" * 32,))  # a plain connection: foreign keys off
    else:
        with store.engine.begin() as conn:
            conn.execute(sa.text("SET LOCAL session_replication_role = replica"))
            conn.exec_driver_sql(insert.replace("?", "%s"), (b"\xdd" * 32,))
    (problem,) = store.fsck().problems
    assert problem.startswith("note ") and problem.endswith(f": step {'d' * 12} is missing")


def _plant_blob(store, content: bytes) -> str:
    address = hashlib.sha256(content).hexdigest()
    tamper(store, "INSERT INTO blobs (hash, size, data, codec) VALUES (:h, :s, :d, NULL)",
           h=bytes.fromhex(address), s=len(content), d=content)
    return address


def _plant_step(store, *, parent=None, depth=1, payload=None, raw=(), lists=None) -> str:
    """A step row written behind kvtrace's back: a hand-made (canonical) body; its id."""
    body = step_body(kind="tool_call", parent=parent, payload=payload or {}, raw=list(raw),
                     meta={}, lists=lists)
    step_id = hashlib.sha256(body).hexdigest()
    tamper(store, "INSERT INTO steps (id, parent_id, kind, depth, body, recorded_at, skip_id, "
           "skip_depth, body_codec) VALUES (:i, :p, 'tool_call', :d, :b, 1.0, NULL, NULL, NULL)",
           i=bytes.fromhex(step_id), p=parent and bytes.fromhex(parent), d=depth, b=body)
    return step_id


def test_fsck_detects_a_list_built_on_a_step_that_is_not_an_ancestor(store):
    message = _plant_blob(store, b'{"role":"user"}')
    other = _plant_step(store, lists={"messages": {"base": None, "items": [message]}})
    root = _plant_step(store, payload={"x": message})
    step = _plant_step(store, parent=root, depth=2,
                       lists={"messages": {"base": other, "items": [message]}})
    problems = store.fsck().problems
    assert problems == [f"step {step[:12]}: list 'messages' builds on {other[:12]}, which is "
                        "not one of its ancestors"]


def test_fsck_detects_a_list_built_on_a_step_without_the_list(store):
    message = _plant_blob(store, b'{"role":"user"}')
    root = _plant_step(store, payload={"x": message})
    step = _plant_step(store, parent=root, depth=2,
                       lists={"messages": {"base": root, "items": [message]}})
    problems = store.fsck().problems
    assert len(problems) == 1 and step[:12] in problems[0] and "no list" in problems[0]


def test_fsck_detects_a_blob_read_as_json_that_is_not_canonical(store):
    address = _plant_blob(store, b'{ "a": 1 }')
    _plant_step(store, payload={"result": address})
    assert store.fsck().problems == [
        f"blob {address[:12]}: a JSON payload blob is not in canonical form"]


def test_fsck_leaves_a_blob_read_as_raw_bytes_unparsed(store):
    address = _plant_blob(store, b'{ "a": 1 }')
    _plant_step(store, payload={"body": address}, raw=["body"])
    assert store.fsck().is_ok


def test_fsck_reads_again_the_json_blobs_of_a_store_with_many_raw_blobs(store, monkeypatch):
    from kvtrace.store.objects import fsck

    monkeypatch.setattr(fsck, "_MAX_NOT_JSON", 1)  # as if it held more raw blobs than that
    raw = [_plant_blob(store, b"data: %d" % i) for i in range(3)]
    _plant_step(store, payload={f"body{i}": a for i, a in enumerate(raw)},
                raw=[f"body{i}" for i in range(3)])
    address = _plant_blob(store, b'{ "a": 1 }')
    _plant_step(store, payload={"result": address})
    assert store.fsck().problems == [
        f"blob {address[:12]}: a JSON payload blob is not in canonical form"]


def test_open_without_create_refuses_a_missing_store(store_urls):
    from kvtrace.errors import StoreNotFoundError

    url = store_urls()
    with pytest.raises(StoreNotFoundError):
        open_store(url, create=False)
    open_store(url).close()
    open_store(url, create=False).close()


def test_sqlite_replace_cannot_rewrite_history(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    _, steps = _linear(store, n=2)
    entry = store.reflog("main")[0]
    with store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "REPLACE INTO reflog (id, ref, old_head, new_head, reason, message, created_at) "
                "VALUES (:i, 'main', NULL, NULL, 'forged', 'x', 0)"
            ),
            {"i": entry.id},
        )
        conn.execute(
            sa.text("REPLACE INTO blobs (hash, size, data) VALUES (:h, 1, :d)"),
            {"h": bytes.fromhex(steps[0].payload["result"]), "d": b"x"},
        )
    assert store.reflog("main")[0] == entry
    assert store.fsck().is_ok
    store.close()
