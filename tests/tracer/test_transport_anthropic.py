"""Anthropic Messages calls through RecordingTransport and ReplayTransport, with the official
`anthropic` SDK (on httpx2) over loopback, against the canned Anthropic server of
tests/canned_apis.py."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx2
import pytest

from kvtrace.store.kinds import HttpExchange, ModelCall
from kvtrace.tracer import (
    AsyncRecordingTransport,
    AsyncReplayTransport,
    RecordingTransport,
    ReplayTransport,
)
from tests.canned import SECRET_KEY, all_blob_bytes
from tests.canned_apis import ANTHROPIC_MODEL, SIGNATURE

MODEL = "claude-canned-4-5"
SYSTEM = [{"type": "text", "text": "You answer questions about the weather.",
           "cache_control": {"type": "ephemeral"}}]
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
THINKING = {"type": "enabled", "budget_tokens": 1024}


def sdk(url: str, transport: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=SECRET_KEY, max_retries=0,
                               http_client=httpx2.Client(transport=transport))


def ask(client: anthropic.Anthropic, messages: list[dict[str, Any]], *,
        stream: bool = False) -> tuple[Any, list[dict[str, Any]]]:
    """One call: (the message, the raw stream events as dicts; [] when not streamed)."""
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 2048, "system": SYSTEM,
                              "tools": TOOLS, "thinking": THINKING,
                              "metadata": {"user_id": "u-1"}}
    if not stream:
        return client.messages.create(messages=messages, **kwargs), []
    with client.messages.stream(messages=messages, **kwargs) as events:
        seen = [event.model_dump() for event in events]
        return events.get_final_message(), seen


def weather_agent(client: anthropic.Anthropic, *, stream: bool = False) -> list[Any]:
    """Ask, run the tool call, answer: both messages and their stream events."""
    first, first_events = ask(client, QUESTION, stream=stream)
    tool_use = next(b for b in first.content if b.type == "tool_use")
    messages = [*QUESTION,
                {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                  for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                              "content": "sunny, 21 C"}]}]
    second, second_events = ask(client, messages, stream=stream)
    return [first, second, first_events, second_events]


def blocks(message: Any) -> list[dict[str, Any]]:
    return [b.model_dump(exclude_none=True) for b in message.content]


def test_messages_become_model_calls_with_blocks_tools_and_usage(store, anthropic_upstream):
    first, second, _, _ = weather_agent(sdk(anthropic_upstream.url,
                                            RecordingTransport(store.run("agent"))))
    assert second.content[-1].text.startswith("It is sunny in Paris")
    one, two = (ModelCall(s) for s in store.path("agent"))
    assert one.api == two.api == "anthropic-messages"
    assert one.native["messages"] == QUESTION
    assert one.native["system"] == SYSTEM
    assert one.native["tools"] == TOOLS
    assert one.native["response"]["content"] == blocks(first)
    assert one.native["response"]["content"][0]["signature"] == SIGNATURE + "1"
    assert one.native["response"]["stop_reason"] == "tool_use"
    assert one.params == {"max_tokens": 2048, "thinking": THINKING,
                          "metadata": {"user_id": "u-1"}}
    assert one.model == ANTHROPIC_MODEL and one.request_model == MODEL
    assert one.extra["response"] == {"id": "msg_01Canned0001", "type": "message",
                                     "model": ANTHROPIC_MODEL}
    assert one.extra["http"]["stream"] is False and one.extra["http"]["complete"] is True
    assert one.raw_usage["cache_read_input_tokens"] == 1024 + 64
    assert one.raw_usage["finish_reason"] == "tool_calls"
    assert one.usage.prompt_tokens == 13 + 96 + 1088  # input + cache writes + cache reads
    assert one.usage.cached_tokens == 1088 and one.usage.cache_write_tokens == 96
    tool_result = two.native["messages"][-1]["content"][0]
    assert tool_result == {"type": "tool_result", "tool_use_id": "toolu_01Canned0001",
                           "content": "sunny, 21 C"}
    assert two.messages[-1] == {"role": "tool", "tool_call_id": "toolu_01Canned0001",
                                "content": "sunny, 21 C"}  # the chat view
    assert one.recorded_stream is None


def test_a_streamed_message_is_recorded_assembled_and_keeps_its_stream(
    store, anthropic_upstream
):
    weather_agent(sdk(anthropic_upstream.url, RecordingTransport(store.run("plain"))))
    client = sdk(anthropic_upstream.url, RecordingTransport(store.run("stream")))
    stream = client.messages.create(model=MODEL, max_tokens=2048, system=SYSTEM, tools=TOOLS,
                                    thinking=THINKING, metadata={"user_id": "u-1"},
                                    messages=QUESTION, stream=True)
    events = [event.type for event in stream]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    call = ModelCall(store.show("stream"))
    content = call.native["response"]["content"]
    assert [b["type"] for b in content] == ["thinking", "text", "tool_use"]
    assert content[0]["signature"].startswith(SIGNATURE)
    assert content[2]["input"] == {"city": "Paris", "units": "celsius"}
    assert call.extra["http"]["stream"] is True and call.extra["http"]["complete"] is True
    assert call.raw_usage["output_tokens"] == 30 + 3  # message_delta's count replaced the start's
    assert call.raw_usage["cache_read_input_tokens"] == 1024 + 64 * 3
    assert call.params == ModelCall(store.path("plain")[0]).params  # `stream` is not a param
    kept = call.recorded_stream
    assert kept is not None and kept.startswith(b"event: message_start")
    assert kept.count(b"event: ping") == 1


def test_replay_serves_messages_offline_with_identical_blocks_and_events(
    store, anthropic_upstream
):
    recorded = weather_agent(sdk(anthropic_upstream.url, RecordingTransport(store.run("a"))))
    recorded_streamed = weather_agent(
        sdk(anthropic_upstream.url, RecordingTransport(store.run("a"))), stream=True)
    raw = sdk(anthropic_upstream.url, RecordingTransport(store.run("a"))).messages.create(
        model=MODEL, max_tokens=2048, system=SYSTEM, tools=TOOLS, thinking=THINKING,
        metadata={"user_id": "u-1"}, messages=QUESTION, stream=True)
    raw_events = [e.model_dump() for e in raw]
    num_steps = len(store.path("a"))
    anthropic_upstream.stop()  # offline from here on
    offline = sdk("http://127.0.0.1:9", ReplayTransport(store.run("a")))
    replayed = weather_agent(offline)
    assert [blocks(m) for m in replayed[:2]] == [blocks(m) for m in recorded[:2]]
    assert replayed[0].usage == recorded[0].usage and replayed[0].id == recorded[0].id
    replayed_streamed = weather_agent(offline, stream=True)
    assert [blocks(m) for m in replayed_streamed[:2]] == [blocks(m) for m in recorded_streamed[:2]]
    assert replayed_streamed[2:] == recorded_streamed[2:]  # the helper's events, one for one
    again = offline.messages.create(model=MODEL, max_tokens=2048, system=SYSTEM, tools=TOOLS,
                                    thinking=THINKING, metadata={"user_id": "u-1"},
                                    messages=QUESTION, stream=True)
    assert [e.model_dump() for e in again] == raw_events
    assert len(store.path("a")) == num_steps  # nothing new recorded


def test_a_call_recorded_without_streaming_is_replayed_as_a_stream(store, anthropic_upstream):
    first, _, _, _ = weather_agent(sdk(anthropic_upstream.url,
                                       RecordingTransport(store.run("plain"))))
    anthropic_upstream.stop()
    offline = sdk("http://127.0.0.1:9", ReplayTransport(store.run("plain")))
    message, events = ask(offline, QUESTION, stream=True)
    assert blocks(message) == blocks(first)
    assert message.stop_reason == "tool_use" and message.usage == first.usage
    assert events[0]["type"] == "message_start"


def test_async_twins_record_and_replay_messages_and_streams(store, anthropic_upstream):
    async def agent(transport: Any) -> list[Any]:
        client = anthropic.AsyncAnthropic(base_url=anthropic_upstream.url, api_key=SECRET_KEY,
                                          max_retries=0,
                                          http_client=httpx2.AsyncClient(transport=transport))
        stream = await client.messages.create(model=MODEL, max_tokens=512, tools=TOOLS,
                                              messages=QUESTION, stream=True)
        events = [event.model_dump() async for event in stream]
        plain = await client.messages.create(model=MODEL, max_tokens=512, messages=QUESTION)
        return [events, blocks(plain)]

    recorded = asyncio.run(agent(AsyncRecordingTransport(store.run("async"))))
    assert recorded[1] == [{"type": "text", "text": "Hello! How can I help you today?"}]
    anthropic_upstream.stop()
    replayed = asyncio.run(agent(AsyncReplayTransport(store.run("async"))))
    assert replayed == recorded
    assert [ModelCall(s).extra["http"]["stream"] for s in store.path("async")] == [True, False]


def test_an_unrecorded_request_gets_anthropics_not_found_error_once(
    sqlite_store, anthropic_upstream
):
    weather_agent(sdk(anthropic_upstream.url, RecordingTransport(sqlite_store.run("a"))))
    seen: list[Any] = []
    replay = ReplayTransport(sqlite_store.run("a"))

    def counting(request: Any) -> Any:
        seen.append(request)
        return replay.handle_request(request)

    client = anthropic.Anthropic(base_url=anthropic_upstream.url, api_key=SECRET_KEY,
                                 http_client=httpx2.Client(
                                     transport=httpx2.MockTransport(counting)))  # retries on
    changed = [{"role": "user", "content": "Weather in Rome?"}]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model=MODEL, max_tokens=2048, system=SYSTEM, tools=TOOLS,
                               thinking=THINKING, metadata={"user_id": "u-1"}, messages=changed)
    assert len(seen) == 1
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "POST /v1/messages was not recorded" in body["error"]["message"]
    assert "messages[0]: recorded user: 'Weather in Paris?', request user: 'Weather in Rome?'" \
        in body["error"]["message"]
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_a_changed_system_prompt_is_named_as_the_difference(sqlite_store, anthropic_upstream):
    weather_agent(sdk(anthropic_upstream.url, RecordingTransport(sqlite_store.run("a"))))
    offline = sdk("http://127.0.0.1:9", ReplayTransport(sqlite_store.run("a")))
    with pytest.raises(anthropic.NotFoundError, match="the system prompt"):
        offline.messages.create(model=MODEL, max_tokens=2048, system="Be brief.", tools=TOOLS,
                                thinking=THINKING, metadata={"user_id": "u-1"},
                                messages=QUESTION)


def post(url: str, transport: Any, messages: list[dict[str, Any]], *,
         stream: bool = True) -> httpx2.Response:
    """A raw Messages request through `transport`, its body read to the end."""
    client = httpx2.Client(transport=transport)
    body = {"model": MODEL, "max_tokens": 512, "tools": TOOLS, "messages": messages,
            "stream": stream}
    return client.post(f"{url}/v1/messages", json=body, headers={"x-api-key": SECRET_KEY})


def test_a_truncated_stream_is_recorded_as_incomplete_with_what_arrived(
    sqlite_store, anthropic_upstream
):
    response = post(anthropic_upstream.url, RecordingTransport(sqlite_store.run("cut")),
                    [{"role": "user", "content": "cut"}])
    assert b"message_stop" not in response.content
    call = ModelCall(sqlite_store.show("cut"))
    assert call.extra["http"]["complete"] is False
    # The text block arrived whole; the tool_use was cut inside its input JSON: left out.
    assert call.native["response"]["content"] == [
        {"type": "text", "text": "Let me check that for you."}]
    assert call.recorded_stream == response.content


def test_unknown_event_types_are_skipped_named_and_replayed(store, anthropic_upstream):
    response = post(anthropic_upstream.url, RecordingTransport(store.run("u")),
                    [{"role": "user", "content": "unknown"}])
    call = ModelCall(store.show("u"))
    assert call.extra["http"]["unknown_events"] == ["content_block_glimmer"]
    assert call.extra["http"]["complete"] is True
    assert [b["type"] for b in call.native["response"]["content"]] == ["text", "tool_use"]
    replayed = post("http://127.0.0.1:9", ReplayTransport(store.run("u")),
                    [{"role": "user", "content": "unknown"}])
    assert replayed.content == response.content  # byte for byte, the unknown event included


@pytest.mark.parametrize("case", ["error", "malformed", "tool_result"])
def test_a_call_that_is_not_one_is_kept_whole_as_an_http_step_saying_why(
    sqlite_store, anthropic_upstream, case
):
    messages = {"error": [{"role": "user", "content": "error"}],
                "malformed": [{"role": "user", "content": "malformed"}],
                "tool_result": [{"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "42"}]}]}
    response = post(anthropic_upstream.url, RecordingTransport(sqlite_store.run("bad")),
                    messages[case], stream=case == "error")
    assert response.status_code == 200
    steps = sqlite_store.path("bad")
    assert [s.kind for s in steps] == ["http"]
    http = HttpExchange(steps[0])
    assert http.response_body == response.content and http.status == 200
    assert http.not_model_call is not None
    assert http.not_model_call.startswith("not an anthropic-messages call")
    assert {"error": "error event: {\"type\": \"overloaded_error\"",
            "malformed": "a tool_use block needs id",
            "tool_result": "answers no tool_use"}[case] in http.not_model_call
    assert http.request_headers["x-api-key"] == "[redacted]"
    assert not any(SECRET_KEY.encode() in blob for blob in all_blob_bytes(sqlite_store))


def test_the_sdk_sees_an_error_event_as_an_error_and_the_exchange_is_kept(
    sqlite_store, anthropic_upstream
):
    client = sdk(anthropic_upstream.url, RecordingTransport(sqlite_store.run("e")))
    with pytest.raises(anthropic.APIStatusError, match="overloaded_error"):
        list(client.messages.create(model=MODEL, max_tokens=512, tools=TOOLS, stream=True,
                                    messages=[{"role": "user", "content": "error"}]))
    (step,) = sqlite_store.path("e")
    assert step.kind == "http" and b"event: error" in HttpExchange(step).response_body


def test_an_edited_copy_of_a_streamed_call_is_replayed_from_its_edited_response(
    sqlite_store, anthropic_upstream
):
    client = sdk(anthropic_upstream.url, RecordingTransport(sqlite_store.run("a")))
    ask(client, QUESTION, stream=True)
    original = ModelCall(sqlite_store.show("a"))
    edited = [{"type": "text", "text": "I would rather not say."}]
    sqlite_store.fork("a", "edited", edit={"response": {**original.native["response"],
                                                       "content": edited,
                                                       "stop_reason": "end_turn"}})
    assert ModelCall(sqlite_store.show("edited")).recorded_stream == original.recorded_stream
    offline = sdk("http://127.0.0.1:9", ReplayTransport(sqlite_store.run("edited")))
    message, _ = ask(offline, QUESTION, stream=True)
    assert blocks(message) == edited  # the kept stream no longer adds up: written anew
    assert message.stop_reason == "end_turn"
    original_run = sdk("http://127.0.0.1:9", ReplayTransport(sqlite_store.run("a")))
    assert [b["type"] for b in blocks(ask(original_run, QUESTION, stream=True)[0])] == [
        "thinking", "text", "tool_use"]
