"""The Python recording API: a run as a context, tool functions recorded call by call."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvtrace import tracer
from kvtrace.tracer import Recorder, current_recorder, recording


def test_recording_block_makes_its_run_current_and_records_into_it(store):
    with recording(store, "agent") as rec:
        assert current_recorder() is rec
        rec.record_model_call([{"role": "user", "content": "hi"}], "hello", model="m")
        rec.record_note("looked fine", author="me")
    assert current_recorder() is None
    assert [s.kind for s in store.path("agent")] == ["model_call", "note"]


def test_recorder_tool_records_arguments_result_duration_and_call_id(store):
    with recording(store, "agent") as rec:

        @rec.tool
        def add(a: int, b: int = 2) -> int:
            return a + b

        assert add(1, tool_call_id="call_1") == 3
    step = store.show("agent")
    assert step.kind == "tool_call"
    assert step.meta["tool"] == "add" and step.meta["call_id"] == "call_1"
    assert step.content == {"arguments": {"a": 1, "b": 2}, "result": 3}
    assert step.meta["timings"]["duration_s"] >= 0


def test_tool_exception_is_recorded_and_raised_unchanged(store):
    with recording(store, "agent"):

        @tracer.tool
        def divide(a: float, b: float) -> float:
            return a / b

        with pytest.raises(ZeroDivisionError):
            divide(1, 0)
    step = store.show("agent")
    assert step.meta["error"] == "ZeroDivisionError: division by zero"
    assert step.content["result"] is None


def test_async_tool_records_into_the_current_run(store):
    @tracer.tool(name="fetch")
    async def fetch_page(url: str) -> dict:
        await asyncio.sleep(0)
        return {"url": url, "status": 200}

    async def agent() -> dict:
        with recording(store, "async-agent"):
            return await fetch_page("https://example.org", tool_call_id="call_9")

    assert asyncio.run(agent()) == {"url": "https://example.org", "status": 200}
    step = store.show("async-agent")
    assert step.meta["tool"] == "fetch" and step.meta["call_id"] == "call_9"
    assert step.content["result"] == {"url": "https://example.org", "status": 200}


def test_a_tool_outside_any_recording_runs_unrecorded(store):
    @tracer.tool
    def echo(text: str) -> str:
        return text

    assert echo("x", tool_call_id="ignored") == "x"
    assert store.runs() == []


def test_a_tool_that_takes_tool_call_id_itself_still_gets_it(store):
    with recording(store, "agent") as rec:

        @rec.tool
        def answer(question: str, tool_call_id: str | None = None) -> str:
            return f"{question}:{tool_call_id}"

        assert answer("q", tool_call_id="call_2") == "q:call_2"
    step = store.show("agent")
    assert step.meta["call_id"] == "call_2"
    assert step.content["arguments"] == {"question": "q"}


def test_results_that_are_not_json_are_stored_as_their_repr(store):
    class Thing:
        def __repr__(self) -> str:
            return "Thing()"

    with recording(store, "agent") as rec:
        rec.tool(lambda: {"thing": Thing(), "items": {1}}, name="make")()
    assert store.show("agent").content["result"] == {"thing": "Thing()", "items": [1]}


def test_two_recorders_on_one_run_interleave_without_losing_a_step(store):
    first, second = Recorder(store.run("shared")), Recorder(store.run("shared"))
    first.record_note("a")
    second.record_note("b")  # its head is stale: it re-reads and appends after "a"
    first.record_note("c")
    assert [s.content["text"] for s in store.path("shared")] == ["a", "b", "c"]


def test_a_recorder_shared_by_threads_records_every_call(store):
    rec = Recorder(store.run("threads"))

    def work(n: int) -> None:
        for i in range(5):
            rec.record_note(f"{n}-{i}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store.path("threads")) == 20
