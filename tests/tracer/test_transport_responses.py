"""OpenAI Responses calls through RecordingTransport and ReplayTransport, with the official
`openai` SDK over loopback, against the canned Responses server of tests/canned_apis.py."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import httpx2
import openai
import pytest

from kvtrace.store.kinds import HttpExchange, ModelCall
from kvtrace.tracer import (
    AsyncRecordingTransport,
    AsyncReplayTransport,
    RecordingTransport,
    ReplayTransport,
)
from tests.canned import SECRET_KEY
from tests.canned_apis import RESPONSES_MODEL

MODEL = "gpt-canned-5"
INSTRUCTIONS = "You answer questions about the weather. Call get_weather before answering."
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"], "additionalProperties": False}}]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
OPTIONS: dict[str, Any] = {"model": MODEL, "instructions": INSTRUCTIONS, "tools": TOOLS,
                           "reasoning": {"effort": "low", "summary": "auto"},
                           "include": ["reasoning.encrypted_content"], "temperature": 0}


def sdk(url: str, transport: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=SECRET_KEY, max_retries=0,
                         http_client=httpx.Client(transport=transport))


def ask(client: openai.OpenAI, items: list[dict[str, Any]], *, stream: bool = False,
        **options: Any) -> tuple[Any, list[dict[str, Any]]]:
    """One call: (the response, its stream events as dicts; [] when not streamed)."""
    if not stream:
        return client.responses.create(input=items, **{**OPTIONS, **options}), []
    with client.responses.stream(input=items, **{**OPTIONS, **options}) as events:
        seen = [event.model_dump(warnings=False) for event in events]
        return events.get_final_response(), seen


def dumped(items: list[Any]) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in items]


def weather_agent(client: openai.OpenAI, *, stream: bool = False,
                  continued: bool = False) -> list[Any]:
    """Ask, run the function call, answer; the second call sends the whole conversation,
    or (`continued`) only the tool output after `previous_response_id`."""
    first, first_events = ask(client, QUESTION, stream=stream)
    call = next(item for item in first.output if item.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    if continued:
        second, second_events = ask(client, [output], stream=stream,
                                    previous_response_id=first.id)
    else:
        second, second_events = ask(client, [*QUESTION, *dumped(first.output), output],
                                    stream=stream)
    return [first, second, first_events, second_events]


def test_responses_become_model_calls_with_items_tools_and_usage(store, responses_upstream):
    first, second, _, _ = weather_agent(sdk(responses_upstream.url,
                                            RecordingTransport(store.run("agent"))))
    assert second.output_text.startswith("It is sunny in Paris")
    one, two = (ModelCall(s) for s in store.path("agent"))
    assert one.api == two.api == "openai-responses"
    assert one.native["input"] == [{"type": "message", **QUESTION[0]}]
    assert one.native["instructions"] == INSTRUCTIONS
    assert one.native["tools"] == TOOLS
    assert one.native["response"] == {"output": dumped(first.output), "status": "completed"}
    assert [i["type"] for i in one.native["response"]["output"]] == ["reasoning",
                                                                     "function_call"]
    assert one.native["response"]["output"][0]["encrypted_content"].startswith("gAAAA")
    assert one.params == {"reasoning": {"effort": "low", "summary": "auto"},
                          "include": ["reasoning.encrypted_content"], "temperature": 0}
    assert one.model == RESPONSES_MODEL and one.request_model == MODEL
    assert one.extra["response"] == {"id": "resp_canned0001", "object": "response",
                                     "created_at": 1760000001, "model": RESPONSES_MODEL,
                                     "error": None, "previous_response_id": None}
    # What the response repeats of its settings: one blob for both calls.
    assert one.response_settings["instructions"] == INSTRUCTIONS
    assert one.response_settings["tools"] == [{"strict": True, **TOOLS[0]}]  # a default added
    assert one.response_settings["temperature"] == 0
    first_step, second_step = store.path("agent")
    assert first_step.payload["response_settings"] == second_step.payload["response_settings"]
    assert one.raw_usage["input_tokens_details"] == {"cached_tokens": 800}
    assert one.raw_usage["finish_reason"] == "tool_calls"
    assert one.usage.prompt_tokens == 940 and one.usage.cached_tokens == 800  # cached inside
    assert two.native["input"][-1] == {"type": "function_call_output",
                                       "call_id": "call_canned0001", "output": "sunny, 21 C"}
    assert two.raw_usage["finish_reason"] == "stop"
    assert "previous_items" not in two.extra


def test_previous_response_id_stores_the_conversation_it_continues(store, responses_upstream):
    first, _, _, _ = weather_agent(sdk(responses_upstream.url,
                                       RecordingTransport(store.run("agent"))), continued=True)
    one, two = (ModelCall(s) for s in store.path("agent"))
    assert two.params["previous_response_id"] == first.id
    assert two.extra["previous_items"] == 1 + len(first.output)
    assert two.native["input"] == [*one.native["input"], *one.native["response"]["output"],
                                   {"type": "function_call_output",
                                    "call_id": "call_canned0001", "output": "sunny, 21 C"}]
    chat = two.messages  # the chat view: the whole conversation, the tool result answering
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool"]
    assert chat[2]["tool_calls"][0]["id"] == chat[3]["tool_call_id"] == "call_canned0001"
    assert chat[2]["reasoning_content"].startswith("**Checking the weather**")


def test_a_previous_response_not_in_the_run_is_stored_as_sent_and_said(
    sqlite_store, responses_upstream
):
    client = sdk(responses_upstream.url, RecordingTransport(sqlite_store.run("late")))
    output = {"type": "function_call_output", "call_id": "call_elsewhere", "output": "42"}
    ask(client, [output], previous_response_id="resp_elsewhere")
    call = ModelCall(sqlite_store.show("late"))
    assert call.native["input"] == [output]
    assert "resp_elsewhere is not a response recorded in run 'late'" in call.extra[
        "previous_missing"]
    assert "previous_items" not in call.extra


def test_a_streamed_response_is_recorded_assembled_and_keeps_its_stream(
    store, responses_upstream
):
    client = sdk(responses_upstream.url, RecordingTransport(store.run("stream")))
    stream = client.responses.create(input=QUESTION, stream=True, **OPTIONS)
    events = [event for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    call = ModelCall(store.show("stream"))
    assert call.native["response"] == {"output": dumped(final.output), "status": "completed"}
    assert call.native["response"]["output"][1]["arguments"] == (
        '{"city": "Paris", "units": "celsius"}')
    assert call.extra["http"]["stream"] is True and call.extra["http"]["complete"] is True
    assert call.raw_usage["input_tokens"] == 940
    kept = call.recorded_stream
    assert kept is not None and kept.startswith(b"event: response.created")
    assert kept.count(b"event: ") == len(events)


def test_replay_serves_responses_offline_with_identical_items_and_events(
    store, responses_upstream
):
    client = sdk(responses_upstream.url, RecordingTransport(store.run("a")))
    recorded = weather_agent(client)
    recorded_continued = weather_agent(client, stream=True, continued=True)
    raw = [e.model_dump() for e in client.responses.create(input=QUESTION, stream=True,
                                                              **{**OPTIONS, "temperature": 1})]
    num_steps = len(store.path("a"))
    responses_upstream.stop()  # offline from here on
    offline = sdk("http://127.0.0.1:9", ReplayTransport(store.run("a")))
    replayed = weather_agent(offline)
    assert [dumped(r.output) for r in replayed[:2]] == [dumped(r.output) for r in recorded[:2]]
    assert replayed[0].usage == recorded[0].usage and replayed[0].id == recorded[0].id
    assert replayed[0].instructions == INSTRUCTIONS  # from the step's response_settings
    assert replayed[0].tools == recorded[0].tools
    replayed_continued = weather_agent(offline, stream=True, continued=True)
    assert replayed_continued[2:] == recorded_continued[2:]  # every event, one for one
    assert replayed_continued[1].id == recorded_continued[1].id
    again = offline.responses.create(input=QUESTION, stream=True, **{**OPTIONS, "temperature": 1})
    assert [e.model_dump() for e in again] == raw
    assert len(store.path("a")) == num_steps  # nothing new recorded


def test_a_response_recorded_without_streaming_is_replayed_as_a_stream(
    store, responses_upstream
):
    first, _, _, _ = weather_agent(sdk(responses_upstream.url,
                                       RecordingTransport(store.run("plain"))))
    responses_upstream.stop()
    offline = sdk("http://127.0.0.1:9", ReplayTransport(store.run("plain")))
    response, events = ask(offline, QUESTION, stream=True)
    assert dumped(response.output) == dumped(first.output)
    assert response.usage == first.usage
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == "response.completed"


def test_async_twins_record_and_replay_responses_and_streams(store, responses_upstream):
    async def agent(transport: Any) -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{responses_upstream.url}/v1", api_key=SECRET_KEY,
                                    max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport))
        stream = await client.responses.create(input=QUESTION, stream=True, **OPTIONS)
        events = [event.model_dump() async for event in stream]
        plain = await client.responses.create(model=MODEL, input="Hello")
        return [events, dumped(plain.output)]

    recorded = asyncio.run(agent(AsyncRecordingTransport(store.run("async"))))
    assert recorded[1][0]["content"][0]["text"] == "Hello! How can I help you today?"
    responses_upstream.stop()
    replayed = asyncio.run(agent(AsyncReplayTransport(store.run("async"))))
    assert replayed == recorded
    assert [ModelCall(s).extra["http"]["stream"] for s in store.path("async")] == [True, False]


@pytest.mark.parametrize(("case", "status", "finish"), [("incomplete", "incomplete", "length"),
                                                        ("failed", "failed", "error")])
def test_incomplete_and_failed_responses_are_calls_with_their_status(
    sqlite_store, responses_upstream, case, status, finish
):
    client = sdk(responses_upstream.url, RecordingTransport(sqlite_store.run(case)))
    client.responses.create(model=MODEL, input=case)
    list(client.responses.create(model=MODEL, input=case, stream=True))
    plain, streamed = (ModelCall(s) for s in sqlite_store.path(case))
    for call in (plain, streamed):
        assert call.native["response"]["status"] == status
        assert call.raw_usage["finish_reason"] == finish
    assert streamed.extra["http"]["complete"] is True  # the terminal event came
    for key in ("status", "incomplete_details"):
        assert streamed.native["response"].get(key) == plain.native["response"].get(key)


def post(url: str, transport: Any, items: Any, *, stream: bool = True) -> httpx.Response:
    """A raw Responses request through `transport`, its body read to the end."""
    body = {"model": MODEL, "tools": TOOLS, "input": items, "stream": stream}
    return httpx.Client(transport=transport).post(
        f"{url}/v1/responses", json=body, headers={"Authorization": f"Bearer {SECRET_KEY}"})


def test_a_truncated_response_stream_is_recorded_as_incomplete(sqlite_store, responses_upstream):
    response = post(responses_upstream.url, RecordingTransport(sqlite_store.run("cut")), "cut")
    call = ModelCall(sqlite_store.show("cut"))
    assert call.extra["http"]["complete"] is False
    (item,) = call.native["response"]["output"]
    assert item["type"] == "function_call" and item["status"] == "in_progress"
    arguments = '{"city": "Paris", "units": "celsius"}'
    assert item["arguments"] == arguments[:len(arguments) // 3]  # the first third arrived
    assert call.native["response"]["status"] == "in_progress"
    assert call.recorded_stream == response.content


def test_events_outside_the_response_family_are_skipped_named_and_replayed(
    store, responses_upstream
):
    response = post(responses_upstream.url, RecordingTransport(store.run("u")), "unknown")
    call = ModelCall(store.show("u"))
    assert call.extra["http"]["unknown_events"] == ["rate_limits.updated"]
    assert call.extra["http"]["complete"] is True
    replayed = post("http://127.0.0.1:9", ReplayTransport(store.run("u")), "unknown")
    assert replayed.content == response.content


@pytest.mark.parametrize("case", ["error", "malformed", "orphan_output"])
def test_a_response_that_is_not_one_is_kept_whole_as_an_http_step_saying_why(
    sqlite_store, responses_upstream, case
):
    items = {"error": "error", "malformed": "malformed",
             "orphan_output": [{"type": "function_call_output", "call_id": "call_nope",
                                "output": "42"}]}[case]
    response = post(responses_upstream.url, RecordingTransport(sqlite_store.run("bad")), items,
                    stream=case == "error")
    assert response.status_code == 200
    (step,) = sqlite_store.path("bad")
    http = HttpExchange(step)
    assert http.response_body == response.content
    assert http.not_model_call is not None
    assert http.not_model_call.startswith("not an openai-responses call")
    assert {"error": '"code": "server_error"', "malformed": "needs a call_id",
            "orphan_output": "answers no function call"}[case] in http.not_model_call


def test_an_unrecorded_response_request_gets_openais_not_found_error(
    sqlite_store, responses_upstream
):
    weather_agent(sdk(responses_upstream.url, RecordingTransport(sqlite_store.run("a"))))
    offline = sdk("http://127.0.0.1:9", ReplayTransport(sqlite_store.run("a")))
    with pytest.raises(openai.NotFoundError) as caught:
        ask(offline, [{"role": "user", "content": "Weather in Rome?"}])
    assert caught.value.code == "unrecorded_request"
    assert "POST /v1/responses was not recorded" in caught.value.message
    assert "input[0]: recorded user: 'Weather in Paris?', request user: 'Weather in Rome?'" \
        in caught.value.message
