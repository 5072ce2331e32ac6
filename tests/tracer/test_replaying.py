"""`kvtrace.replaying(run, until=K)`: an agent's tools and model calls answered from its
recording up to step K, live after it on one fork.

The agent is a ten-call openai-SDK agent whose `kvtrace.tool` appends to a
file; it records itself (`kvtrace.recording` and a `RecordingTransport`
on its run) and is run again unchanged inside the block, against the
canned OpenAI-style server on loopback, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import kvtrace
from kvtrace.errors import (
    KvtraceError,
    NotFoundError,
    RecordedToolError,
    UsageError,
)
from kvtrace.store import ModelCall, StepKind, ToolCall
from kvtrace.tracer import AsyncRecordingTransport, RecordingTransport
from tests.canned import SECRET_KEY

TOOLS = [{"type": "function", "function": {
    "name": "write_note", "description": "Append a line to notes.txt.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]
START = [{"role": "system", "content": "You keep notes."},
         {"role": "user", "content": "Write the first note."}]
CALLS = 10


class NoteAgent:
    """The agent: each turn asks the model, then writes the answer with its tool.

    `ran` counts the tool function's real runs (each writes `notes.txt`);
    `seen` is what each tool call gave back to the agent. With `vary_turn`,
    the agent calls its tool with other arguments at that turn.
    """

    def __init__(self, folder: Path, *, vary_turn: int | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.notes = folder / "notes.txt"
        self.vary_turn = vary_turn
        self.ran: list[int] = []
        self.seen: list[Any] = []

        @kvtrace.tool
        def write_note(text: str, turn: int) -> dict[str, Any]:
            self.ran.append(turn)
            with self.notes.open("a", encoding="utf-8") as notes:
                notes.write(f"{turn}: {text}\n")
            return {"wrote": len(text), "turn": turn}

        @kvtrace.tool(name="write_note")
        async def write_note_async(text: str, turn: int) -> dict[str, Any]:
            await asyncio.sleep(0)
            return write_note.__wrapped__(text, turn)

        self.write_note = write_note
        self.write_note_async = write_note_async

    def _turn(self, messages: list[Any], turn: int, message: Any) -> tuple[str, str]:
        text = message.content or message.tool_calls[0].function.arguments
        if turn == self.vary_turn:
            text += " (changed)"
        call_id = f"call_{turn}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "write_note", "arguments": json.dumps({"text": text})}}]})
        return text, call_id

    def _answered(self, messages: list[Any], call_id: str, result: Any) -> None:
        self.seen.append(result)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)})

    def run(self, store: Any, run: str, url: str) -> None:
        with kvtrace.recording(store, run) as rec:
            client = openai.OpenAI(base_url=url, api_key=SECRET_KEY, max_retries=0,
                                   http_client=httpx.Client(transport=RecordingTransport(rec)))
            messages = list(START)
            for turn in range(CALLS):
                reply = client.chat.completions.create(
                    model="canned-model", messages=messages, tools=TOOLS, temperature=0)
                text, call_id = self._turn(messages, turn, reply.choices[0].message)
                self._answered(messages, call_id,
                               self.write_note(text, turn, tool_call_id=call_id))

    async def run_async(self, store: Any, run: str, url: str) -> None:
        with kvtrace.recording(store, run) as rec:
            client = openai.AsyncOpenAI(
                base_url=url, api_key=SECRET_KEY, max_retries=0,
                http_client=httpx.AsyncClient(transport=AsyncRecordingTransport(rec)))
            messages = list(START)
            for turn in range(CALLS):
                reply = await client.chat.completions.create(
                    model="canned-model", messages=messages, tools=TOOLS, temperature=0)
                text, call_id = self._turn(messages, turn, reply.choices[0].message)
                self._answered(messages, call_id,
                               await self.write_note_async(text, turn, tool_call_id=call_id))


@pytest.fixture
def recorded(store, canned_upstream, tmp_path) -> tuple[Any, NoteAgent]:
    """Run `base`: ten model calls, each followed by its tool call (20 steps)."""
    agent = NoteAgent(tmp_path / "base")
    agent.run(store, "base", canned_upstream.url)
    kinds = [s.kind for s in store.path("base")]
    assert kinds == [StepKind.MODEL_CALL, StepKind.TOOL_CALL] * CALLS
    assert agent.ran == list(range(CALLS))
    return store, agent


def _ids(store, run: str) -> list[str]:
    return [s.id for s in store.path(run)]


def test_steps_up_to_k_are_served_and_the_rest_run_live_on_one_fork(
        recorded, canned_upstream, tmp_path):
    store, base = recorded
    sent_before = len(canned_upstream.seen)
    agent = NoteAgent(tmp_path / "replay")
    with kvtrace.replaying("base", until=6, store=store) as replay:
        agent.run(store, "base", canned_upstream.url)
    # Steps 1..6 are three model calls and three tool calls: the tool ran from turn 3 on.
    assert agent.ran == list(range(3, CALLS))
    assert agent.notes.read_text().splitlines()[0].startswith("3: ")
    assert agent.seen == base.seen  # the recorded results came back as they were
    assert len(canned_upstream.seen) == sent_before + CALLS - 3  # only the live calls went out
    summary = replay.summary
    assert (summary.num_recorded, summary.num_served, summary.first_live_step,
            summary.fork, summary.parted) == (6, 6, 7, "base-from-6", None)
    fork = store.path("base-from-6")
    assert [s.id for s in fork[:6]] == _ids(store, "base")[:6]  # the parent's own steps
    assert [s.kind for s in fork[6:]] == [StepKind.MODEL_CALL, StepKind.TOOL_CALL] * 7
    assert [ToolCall(s).arguments["turn"] for s in fork[7::2]] == list(range(3, CALLS))
    assert len(store.path("base")) == 2 * CALLS  # the recording is untouched
    assert replay.fork is not None and replay.fork.name == "base-from-6"


def test_an_edited_tool_result_at_step_k_is_what_the_agent_sees(
        recorded, canned_upstream, tmp_path):
    store, base = recorded
    edited = {"wrote": 0, "turn": 2, "note": "the disk was full"}
    agent = NoteAgent(tmp_path / "edit")
    with kvtrace.replaying("base", until=6, store=store, fork="full",
                           edit={"result": edited}) as replay:
        agent.run(store, "base", canned_upstream.url)
    assert agent.seen[2] == edited and agent.seen[:2] == base.seen[:2]
    assert agent.ran == list(range(3, CALLS))
    assert replay.summary.edit_seen is True
    fork, original = store.path("full"), store.path("base")
    assert [s.id for s in fork[:5]] == [s.id for s in original[:5]]
    assert ToolCall(fork[5]).result == edited
    assert fork[5].meta["edit_of"] == original[5].id
    # The first live model call sent the edited result: a true counterfactual.
    assert ModelCall(fork[6]).messages[-1]["content"] == json.dumps(edited)
    assert fork[6].parent_id == fork[5].id


def test_an_edited_model_response_at_step_k_is_what_the_agent_acts_on(
        recorded, canned_upstream, tmp_path):
    store, _ = recorded
    agent = NoteAgent(tmp_path / "edit-model")
    with kvtrace.replaying("base", until=5, store=store, fork="answer", edit={
            "response": {"role": "assistant", "content": "an edited answer"}}) as replay:
        agent.run(store, "base", canned_upstream.url)
    assert replay.summary.edit_seen is True
    assert agent.ran == list(range(2, CALLS))  # step 6, turn 2's tool call, ran live
    fork = store.path("answer")
    assert fork[4].meta["edit_of"] == store.path("base")[4].id
    assert ToolCall(fork[5]).arguments["text"] == "an edited answer"
    assert [s.kind for s in fork[5:]] == [StepKind.TOOL_CALL] + [
        StepKind.MODEL_CALL, StepKind.TOOL_CALL] * 7


def test_a_tool_call_that_differs_before_k_goes_live_at_once(
        recorded, canned_upstream, tmp_path):
    store, _ = recorded
    sent_before = len(canned_upstream.seen)
    agent = NoteAgent(tmp_path / "vary", vary_turn=1)
    with kvtrace.replaying("base", until=6, store=store) as replay:
        agent.run(store, "base", canned_upstream.url)
    assert agent.ran == list(range(1, CALLS))  # turn 1's tool call (step 4) ran
    assert len(canned_upstream.seen) == sent_before + CALLS - 2
    summary = replay.summary
    assert (summary.num_served, summary.first_live_step) == (3, 4)
    assert "tool write_note" in (summary.parted or "")
    assert "(#4)" in (summary.parted or "")
    fork = store.path("base-from-6")
    assert [s.id for s in fork[:3]] == _ids(store, "base")[:3]
    assert ToolCall(fork[3]).arguments["text"].endswith("(changed)")
    assert len(fork) == 2 * CALLS


def test_async_agents_and_async_tools_are_replayed_too(recorded, canned_upstream, tmp_path):
    store, base = recorded
    agent = NoteAgent(tmp_path / "async")
    with kvtrace.replaying("base", until=6, store=store) as replay:
        asyncio.run(agent.run_async(store, "base", canned_upstream.url))
    assert agent.ran == list(range(3, CALLS))
    assert agent.seen == base.seen
    assert replay.summary.num_served == 6
    fork = store.path("base-from-6")
    assert [s.id for s in fork[:6]] == _ids(store, "base")[:6]
    assert [s.kind for s in fork[6:]] == [StepKind.MODEL_CALL, StepKind.TOOL_CALL] * 7


def test_other_http_of_the_agent_is_served_from_the_recording(sqlite_store, canned_upstream):
    store = sqlite_store

    def agent() -> dict[str, Any]:
        with kvtrace.recording(store, "fetch") as rec:
            client = httpx.Client(transport=RecordingTransport(rec))
            return client.get(f"{canned_upstream.url}/models").json()

    listed = agent()
    sent_before = len(canned_upstream.seen)
    with kvtrace.replaying("fetch", until=1, store=store) as replay:
        assert agent() == listed
    assert len(canned_upstream.seen) == sent_before
    assert (replay.summary.num_served, replay.fork) == (1, None)  # nothing went live


def test_a_recorded_error_is_raised_again_without_running_the_tool(sqlite_store):
    store = sqlite_store
    ran: list[str] = []

    class QuotaError(Exception):
        pass

    @kvtrace.tool
    def read(path: str) -> str:
        ran.append(path)
        if path == "quota":
            raise QuotaError("over quota")
        return Path(path).read_text()

    def agent() -> list[str]:
        outcomes = []
        with kvtrace.recording(store, "reads"):
            for path in ("/nonexistent/kvtrace", "quota"):
                try:
                    outcomes.append(read(path))
                except Exception as exc:
                    outcomes.append(f"{type(exc).__name__}: {exc}")
        return outcomes

    recorded = agent()
    ran.clear()
    with kvtrace.replaying("reads", until=2, store=store):
        with pytest.raises(FileNotFoundError) as missing:
            read("/nonexistent/kvtrace")
        with pytest.raises(RecordedToolError) as quota:
            read("quota")
    assert ran == []
    assert f"FileNotFoundError: {missing.value}" == recorded[0]
    assert (quota.value.type_name, str(quota.value)) == ("QuotaError", recorded[1])


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"run": "nope", "until": 2}, NotFoundError, "no run named 'nope'"),
    ({"run": "base", "until": 21}, NotFoundError, "outside run 'base', which has 20 steps"),
    ({"run": "base", "until": 0}, UsageError, "until must be a step number"),
    ({"run": "base", "until": 6, "edit": {"response": {}}}, UsageError,
     "no field 'response'"),
    ({"run": "base", "until": 5, "edit": {"result": 1}}, UsageError, "no field 'result'"),
    ({"run": "base", "until": 6, "edit": {"result": object()}}, UsageError,
     "must be JSON data"),
    ({"run": "base", "until": 6, "fork": "base"}, UsageError, "exists already"),
])
def test_bad_input_raises_one_line_and_records_nothing(recorded, options, error, message):
    store, _ = recorded
    before = [(info.name, info.head_id) for info in store.runs()]
    with pytest.raises(error, match=message) as raised, kvtrace.replaying(store=store,
                                                                          **options):
        pytest.fail("the block must not start")
    assert "\n" not in str(raised.value)
    assert [(info.name, info.head_id) for info in store.runs()] == before


def test_an_edit_of_a_step_that_recorded_an_error_is_refused(sqlite_store):
    store = sqlite_store
    store.run("r").record_tool_call("t", {}, None, error="OSError: disk")
    with pytest.raises(UsageError, match="recorded an error"), kvtrace.replaying(
            "r", until=1, store=store, edit={"result": "ok"}):
        pass


def test_replaying_blocks_do_not_nest_and_need_a_store(recorded):
    store, _ = recorded
    with pytest.raises(UsageError, match="needs the store"), kvtrace.replaying("base", until=2):
        pass
    with (kvtrace.replaying(store.run("base"), until=2),
          pytest.raises(KvtraceError, match="do not nest"),
          kvtrace.replaying("base", until=2, store=store)):
        pass
    assert kvtrace.tracer.current_replaying() is None
