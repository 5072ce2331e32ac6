"""Long runs cost what they hold, not n histories: work counted per message, never timed.

A conversation of n calls holds about 2n messages; each call's prompt holds
all earlier ones. These tests count the work (messages normalised and
encoded on import, list items decoded on reading, messages a report keeps)
and hold it to a bound linear in the messages, where a call that handled
its whole history would do n^2/2 of it. Ids are pinned: a call given as the
previous call's messages plus new ones is the same step as given whole.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvtrace.apis import chat
from kvtrace.bench.longrun import long_conversation
from kvtrace.errors import UsageError
from kvtrace.formats import import_openai
from kvtrace.page import gather
from kvtrace.store.objects import codec, encoding

# Past MAX_DEPTH (64) calls, so each 64th call names every message again (the encoding's rule).
NUM_TURNS = 150
# Heads of the two conversations of `_record`, recorded whole by main before `continues`
# existed (d1f12dc): the ids must never change.
PINNED = {
    1: "df0cd35e9f5d52aa263ab5025cb8c9674a52b674ae3012ae489d3e8434f4eaac",
    20: "47651d48a5d0e40608087bf2a7b9eef6e5a6c4f3e62e8c16e17b90ba5ae1b46c",
}


def _conversation(num_calls):
    chat = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    calls = []
    for i in range(num_calls):
        response = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
        calls.append((len(chat), response))
        chat += [response, {"role": "tool", "tool_call_id": f"c{i}", "content": f"r{i}"}]
    return chat, calls


def _record(store, *, continues, gap):
    """The conversation as model calls (whole, or continuing the previous call's) with tool
    steps between; every tenth call, `gap` tool steps (more than the store searches back)."""
    chat, calls = _conversation(NUM_TURNS)
    run, sent, ids = store.run(f"c{int(continues)}-{gap}"), 0, []
    for i, (end, response) in enumerate(calls):
        if continues and i:
            step = run.record_model_call(chat[sent:end], response, model="m", continues=True)
        else:
            step = run.record_model_call(chat[:end], response, model="m")
        assert step.content["messages"] == chat[:end]
        sent = end
        ids.append(step.id)
        for _ in range(gap if i % 10 == 3 else 1):
            ids.append(run.record_tool_call("f", {}, f"r{i}", call_id=f"c{i}").id)
    return ids


@pytest.mark.parametrize("gap", [1, 20])
def test_a_continued_call_is_the_step_its_whole_conversation_makes(store, gap):
    whole = _record(store, continues=False, gap=gap)
    assert _record(store, continues=True, gap=gap) == whole
    assert whole[-1] == PINNED[gap]
    assert store.fsck().is_ok


def test_continues_needs_an_earlier_chat_call_of_the_run(store):
    run = store.run("fresh")
    with pytest.raises(UsageError, match="earlier model call"):
        run.record_model_call([{"role": "user", "content": "hi"}], "a", model="m",
                              continues=True)
    run.record_model_call([{"role": "user", "content": "hi"}], "a", model="m")
    with pytest.raises(UsageError, match="openai-chat"):
        run.record_model_call([], {"content": [{"type": "text", "text": "b"}]}, model="m",
                              api="anthropic-messages", continues=True)


class _Counted:
    """Counts the calls of one module function (wrapping it: the real function still runs)."""

    def __init__(self, monkeypatch, module, name):
        self.calls = 0
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


def test_an_import_normalises_and_encodes_each_message_a_bounded_number_of_times(
        store, monkeypatch):
    document = long_conversation(NUM_TURNS)
    num_messages = len(document["messages"])
    normalised = _Counted(monkeypatch, chat, "normalize_message")
    encoded = _Counted(monkeypatch, encoding, "canonical_json")
    import_openai(store, document, run="long")
    # Checked once when the document is read, once when recorded; each call adds its
    # response, tools, extra and body. A call that handled its history: ~n^2/2 = 11,000+.
    assert normalised.calls <= 2 * num_messages + 2 * NUM_TURNS
    assert encoded.calls <= num_messages + 6 * NUM_TURNS


def test_a_walk_reads_and_decodes_each_message_once(store, monkeypatch):
    document = long_conversation(NUM_TURNS)
    import_openai(store, document, run="long")
    # The messages of prompts that are no call's response (a response is also read as
    # its own step's payload): each read from the store once in the whole walk.
    addresses = {encoding.sha256_hex(encoding.canonical_json(m))
                 for m in chat.normalize_messages(document["messages"][:-2])
                 if m["role"] != "assistant"}
    read: list[str] = []
    real_read = codec.read

    def counted(conn, addresses):
        wanted = sorted(set(addresses))
        read.extend(wanted)
        return real_read(conn, wanted)

    monkeypatch.setattr(codec, "read", counted)
    steps = list(store.walk("long"))
    calls = [s for s in steps if s.kind == "model_call"]
    in_prompts = Counter(a for a in read if a in addresses)
    assert set(in_prompts) == addresses and set(in_prompts.values()) == {1}  # each read once
    # The steps share the decoded messages: a conversation is held once, not per call.
    assert calls[-1].content["messages"][5] is calls[-2].content["messages"][5]
    middle = calls[70].content["messages"]  # past a step that names every message again
    assert calls[-1].content["messages"][len(middle) - 1] is middle[-1]


def test_a_listing_reads_no_conversation(store, monkeypatch):
    import_openai(store, long_conversation(NUM_TURNS), run="long")
    read: list[str] = []
    real_read = codec.read
    monkeypatch.setattr(codec, "read", lambda conn, a: read.extend(a) or real_read(conn, a))
    steps = list(store.log("long", lists=False))
    payload = {address for s in steps for address in s.payload.values()}
    assert set(read) == payload  # responses, tool results: no message of any prompt
    assert all("messages" not in s.content for s in steps)


def test_a_growth_walk_gives_each_message_once(store):
    document = long_conversation(NUM_TURNS)
    import_openai(store, document, run="long")
    added = [grown["messages"] for _, grown in store.walk_growth("long") if grown]
    assert len(added) == NUM_TURNS
    # Every message before the last answer, once (the answer and what follows: no prompt).
    assert sum(len(g.items) for g in added) == len(document["messages"]) - 2
    assert all(g.num_kept + len(g.items) == g.num_items for g in added)


def test_a_report_keeps_each_message_once(store):
    document = long_conversation(NUM_TURNS)
    import_openai(store, document, run="long")
    page = gather(store, ["long"])
    prompts = [s.prompt for s in page.runs[0].steps if s.prompt is not None]
    assert len(prompts) == NUM_TURNS
    # Each call shows what it adds: its new messages, the previous answer not again.
    shown = sum(len(p.new) for p in prompts)
    assert shown == len(document["messages"]) - NUM_TURNS - 1
    assert all(p.num_known + len(p.new) == p.num_messages for p in prompts)
    assert all("messages" not in s.step.content for s in page.runs[0].steps)
