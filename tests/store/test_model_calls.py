"""Model calls in the function-calling format, stored message by message (both backends)."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from kvtrace import open_store
from kvtrace.apis.chat import normalize_message
from kvtrace.bench.conversations import tool_calling_conversation
from kvtrace.errors import IntegrityError, UsageError
from kvtrace.store.objects import bodies, codec, lists
from kvtrace.store.objects.encoding import canonical_json
from tests.conftest import tamper

OLD_STORE = Path(__file__).parent / "data" / "store_v1.db"


def _blobs(store) -> dict[str, bytes]:
    """The content of every blob, by address."""
    with store.engine.connect() as conn:
        kept = conn.execute(sa.text("SELECT hash FROM blobs")).scalars()
        return codec.read(conn, [bytes(address).hex() for address in kept])


def _list_entries(store) -> list[dict]:
    """The "messages" entry of every model call's body."""
    with store.engine.connect() as conn:
        kept = conn.execute(sa.text("SELECT body, body_codec FROM steps")).all()
    found = [json.loads(bodies.decode(body, body_codec)) for body, body_codec in kept]
    return [b["lists"]["messages"] for b in found if "messages" in b.get("lists", {})]


def _record(run, calls, *, tool_steps: bool = True):
    for call in calls:
        run.record_model_call(call.messages, call.response, model="gpt-4o", tools=call.tools,
                              usage=call.usage)
        if tool_steps:
            for call_id, name, arguments, result in call.results:
                run.record_tool_call(name, arguments, result, call_id=call_id)


def test_a_60_call_conversation_stores_each_distinct_message_once(store):
    calls = tool_calling_conversation(60)
    _record(store.run("long"), calls, tool_steps=False)
    distinct = {canonical_json(normalize_message(m)) for c in calls
                for m in [*c.messages, c.response]}
    blobs = _blobs(store)
    message_blobs = [d for d in blobs.values() if d in distinct]
    assert len(message_blobs) == len(distinct)  # every distinct message, once
    assert len(blobs) == len(distinct) + 1  # + the tools list, and nothing else
    entries = _list_entries(store)
    assert len(entries) == 60 and sum(e["base"] is None for e in entries) == 1
    assert max(len(e["items"]) for e in entries[1:]) <= 3  # each names only the new messages
    steps = [s for s in store.path("long") if s.kind == "model_call"]
    assert [s.content["messages"] for s in steps] == [
        [normalize_message(m) for m in c.messages] for c in calls]


def test_history_is_shared_by_a_writer_that_opens_the_run_again(store_url):
    calls = tool_calling_conversation(6)
    first = open_store(store_url)
    _record(first.run("r"), calls[:3])
    first.close()
    second = open_store(store_url)  # a new process continuing the run finds the base
    _record(second.run("r"), calls[3:])
    assert sum(e["base"] is None for e in _list_entries(second)) == 1
    assert second.fsck().is_ok
    second.close()


def test_long_conversations_cap_the_segment_chain_and_still_load(store):
    run = store.run("cap")
    messages = [{"role": "user", "content": "start"}]
    for i in range(lists.MAX_DEPTH + 6):
        step = run.record_model_call(messages, f"answer {i}", model="m")
        messages = [*messages, step.content["response"], {"role": "user", "content": f"q{i}"}]
    assert sum(e["base"] is None for e in _list_entries(store)) == 2  # a full list restarts it
    assert store.show("cap").content["messages"] == messages[:-2]
    assert store.fsck().is_ok


def test_sdk_objects_and_dicts_record_the_same_step(store):
    from openai.types.chat import ChatCompletionMessage

    @dataclass
    class Message:
        role: str
        content: str

    response = ChatCompletionMessage.model_validate({
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'}}]})
    a = store.run("sdk").record_model_call([Message("user", "hi")], response, model="m")
    b = store.run("dict").record_model_call(
        [{"role": "user", "content": "hi"}],
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": {"x": 1}}}]},
        model="m")
    assert a.id == b.id
    assert a.content["response"]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'


def test_tool_calls_link_to_their_model_call(store):
    calls = tool_calling_conversation(2)
    run = store.run("link")
    _record(run, calls)
    step = next(s for s in store.path("link") if s.kind == "tool_call")
    asked = calls[0].response["tool_calls"][0]
    assert step.meta["call_id"] == asked["id"]
    assert step.meta["tool"] == asked["function"]["name"]


@pytest.mark.parametrize(("messages", "response", "where"), [
    ("hi", "ok", "messages must be a list"),
    ([{"role": "robot", "content": "x"}], "ok", r"messages\[0\]\.role"),
    ([{"role": "user", "content": 5}], "ok", r"messages\[0\]\.content"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "ok", r"messages\[0\]\.content\[0\]"),
    ([], {"role": "assistant", "tool_calls": [{"function": {}}]},
     r"response\.tool_calls\[0\]\.function needs a name"),
    ([], {"role": "user", "content": "x"}, "a response is an assistant message"),
])
def test_malformed_model_calls_are_refused_naming_the_element(store, messages, response, where):
    run = store.run("bad")
    with pytest.raises(UsageError, match=where):
        run.record_model_call(messages, response, model="m")
    assert store.head("bad") is None and not _blobs(store)


def test_bundles_carry_message_lists_across_stores(store, store_urls):
    _record(store.run("b"), tool_calling_conversation(5))
    buffer = io.BytesIO()
    store.export_run("b", buffer)
    other = open_store(store_urls())
    other.import_bundle(io.BytesIO(buffer.getvalue()))
    assert [s.id for s in other.path("b")] == [s.id for s in store.path("b")]
    assert other.show("b").content == store.show("b").content
    assert other.fsck().is_ok
    other.close()


def test_a_bundle_missing_a_message_is_refused_and_changes_nothing(store, store_urls):
    _record(store.run("b"), tool_calling_conversation(3), tool_steps=False)
    buffer = io.BytesIO()
    store.export_run("b", buffer)
    message = canonical_json(normalize_message(tool_calling_conversation(3)[1].messages[-1]))
    lines = [line for line in buffer.getvalue().splitlines()
             if not (b'"blob"' in line and _decoded(line) == message)]
    other = open_store(store_urls())
    with pytest.raises(IntegrityError):
        other.import_bundle(io.BytesIO(b"\n".join(lines)))
    assert other.runs() == [] and not _blobs(other)
    other.close()


def _decoded(line: bytes) -> bytes:
    import base64

    return base64.b64decode(json.loads(line)["data"])


def test_fsck_finds_a_message_missing_from_a_list(store):
    calls = tool_calling_conversation(3)
    _record(store.run("f"), calls, tool_steps=False)
    message = canonical_json(normalize_message(calls[2].messages[-1]))
    address = next(h for h, d in _blobs(store).items() if d == message)
    tamper(store, "DELETE FROM blobs WHERE hash = :h", h=bytes.fromhex(address))
    problems = store.fsck().problems
    assert any(address[:12] in p and "missing" in p for p in problems)


def test_a_store_written_by_the_version_1_encoding_still_works(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(OLD_STORE, path)
    store = open_store(f"sqlite:///{path}")  # migrates to the current schema
    report = store.fsck()
    assert report.is_ok and report.num_steps == 5
    old = list(store.path("old"))
    assert old[0].id == "ece2c862e3321b400a35f790b44d92af11f286205382e1decbd28c762f4487f8"
    assert old[0].content["response"]["tool_calls"][0]["function"]["name"] == "calc"
    assert old[3].content["response"] == "4"  # a version-1 plain-string response, as recorded
    run = store.run("old")  # new steps (version 2) go on top of version-1 history
    step = run.record_model_call([*old[3].content["messages"], {"role": "assistant",
                                 "content": "4"}, {"role": "user", "content": "Thanks"}],
                                 "You're welcome.", model="m")
    assert step.parent_id == old[3].id and store.fsck().is_ok
    buffer = io.BytesIO()
    store.export_run("old", buffer)
    fresh = open_store(f"sqlite:///{tmp_path / 'fresh.db'}")
    fresh.import_bundle(io.BytesIO(buffer.getvalue()))
    assert [s.id for s in fresh.path("old")] == [s.id for s in store.path("old")]
    assert fresh.fsck().is_ok
    fresh.close()
    store.close()


def test_the_version_1_store_analyzes(tmp_path):
    from kvtrace.replay import analyze
    from tests.replay.conftest import ByteTokenizer

    path = tmp_path / "old.db"
    shutil.copy(OLD_STORE, path)
    store = open_store(f"sqlite:///{path}")
    analysis = analyze(store, "old", ByteTokenizer())
    assert len(analysis.steps) == 3 and analysis.oracle_tokens > 0
    assert not analysis.breakers  # v1 and v2 messages render the same
    store.close()


def test_a_batch_lands_whole_or_not_at_all(store):
    with pytest.raises(RuntimeError), store.batch():
        run = store.run("half")
        run.record_tool_call("t", {"i": 1}, 1)
        run.record_model_call([{"role": "user", "content": "q"}], "a", model="m")
        raise RuntimeError("the database went away half-way")
    assert store.runs() == [] and not _blobs(store) and store.fsck().num_steps == 0
    with store.batch():
        run = store.run("whole")
        run.record_tool_call("t", {"i": 1}, 1)
        run.record_model_call([{"role": "user", "content": "q"}], "a", model="m")
    assert store.head("whole").depth == 2 and store.fsck().is_ok
    with pytest.raises(UsageError), store.batch(), store.batch():
        pass


def _forged_bundle(store, base_of_last: str) -> bytes:
    """A bundle of run "b" whose last model call claims another base step (re-hashed)."""
    import hashlib

    buffer = io.BytesIO()
    store.export_run("b", buffer)
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    steps = [line for line in lines if "step" in line]
    last = steps[-1]
    body = json.loads(last["body"])
    body["lists"]["messages"]["base"] = base_of_last
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    new_id = hashlib.sha256(text.encode()).hexdigest()
    last.update(step=new_id, body=text)
    lines[0]["head"] = new_id
    return b"\n".join(json.dumps(line).encode() for line in lines)


@pytest.mark.parametrize("which", ["a note, which has no messages", "a step off the chain"])
def test_a_bundle_whose_list_builds_on_a_non_ancestor_is_refused(store, store_urls, which):
    run = store.run("b")
    run.record_model_call([{"role": "user", "content": "q1"}], "a1", model="m")
    note = run.record_note("between")
    run.record_model_call([{"role": "user", "content": "q1"}, {"role": "assistant",
                          "content": "a1"}, {"role": "user", "content": "q2"}], "a2", model="m")
    other = store.run("elsewhere").record_model_call([{"role": "user", "content": "q1"}], "a1",
                                                      model="other")
    forged = _forged_bundle(store, note.id if which.startswith("a note") else other.id)
    target = open_store(store_urls())
    if not which.startswith("a note"):  # the off-chain step is in the target store
        target.run("elsewhere").record_model_call([{"role": "user", "content": "q1"}], "a1",
                                                   model="other")
    before = target.runs()
    with pytest.raises(IntegrityError):
        target.import_bundle(io.BytesIO(forged), name="forged")
    assert target.runs() == before
    target.close()
