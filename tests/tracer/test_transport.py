"""RecordingTransport and ReplayTransport with the official openai SDK and plain httpx,
over real loopback sockets against a canned OpenAI-style server."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kvtrace.errors import UnrecordedRequestError, UsageError
from kvtrace.tracer import (
    AsyncRecordingTransport,
    AsyncReplayTransport,
    RecordingTransport,
    ReplayTransport,
)
from tests.canned import CANNED_COMPLETION, SECRET_KEY, all_blob_bytes, all_step_meta

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}]
QUESTION = [{"role": "system", "content": "You answer about weather."},
            {"role": "user", "content": "Weather in Paris?"}]


def sdk(url: str, transport: httpx.BaseTransport) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=SECRET_KEY, max_retries=0,
                         http_client=httpx.Client(transport=transport))


def run_weather_agent(client: openai.OpenAI) -> str:
    """A two-call function-calling agent: ask, run the tool call, answer."""
    first = client.chat.completions.create(model="canned-model", messages=QUESTION, tools=TOOLS,
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="canned-model", messages=messages, tools=TOOLS,
                                            temperature=0)
    return second.choices[0].message.content


def test_chat_completions_become_model_calls_with_tools_usage_and_tool_calls(
    store, canned_upstream
):
    run = store.run("agent")
    assert run_weather_agent(sdk(canned_upstream.url, RecordingTransport(run))) == (
        "It is sunny in Paris.")
    first, second = store.path("agent")
    assert first.kind == second.kind == "model_call"
    assert first.content["messages"] == QUESTION
    assert first.content["tools"] == TOOLS
    assert first.content["response"]["tool_calls"] == [{
        "id": "call_abc", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert first.meta["model"] == "canned-model"
    assert first.meta["params"] == {"temperature": 0}
    assert first.meta["usage"]["cached_tokens"] == 32
    assert first.meta["usage"]["finish_reason"] == "tool_calls"
    assert first.meta["extra"]["response"]["id"] == "chatcmpl-canned-1"
    assert second.content["messages"][-1] == {
        "role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21 C"}
    assert "cached_tokens" not in second.meta["usage"]  # not reported: unknown, not zero


def test_the_client_gets_the_upstream_bytes_unchanged(sqlite_store, canned_upstream):
    client = httpx.Client(transport=RecordingTransport(sqlite_store.run("raw")))
    response = client.post(f"{canned_upstream.url}/chat/completions",
                           json={"model": "canned-model", "messages": QUESTION})
    assert response.content == CANNED_COMPLETION


def test_a_stream_passes_through_and_is_recorded_assembled(store, canned_upstream):
    client = sdk(canned_upstream.url, RecordingTransport(store.run("stream")))
    stream = client.chat.completions.create(model="canned-model", messages=QUESTION, tools=TOOLS,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "Let me check.")
    step = store.show("stream")
    assert step.content["response"] == {
        "role": "assistant", "content": "Let me check.",
        "tool_calls": [{"id": "call_s1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert step.meta["usage"]["cached_tokens"] == 16
    assert step.meta["extra"]["http"]["stream"] is True
    assert step.meta["extra"]["http"]["complete"] is True
    assert step.meta["extra"]["stream_options"] == {"include_usage": True}


def test_an_abandoned_stream_is_recorded_as_such(sqlite_store, canned_upstream):
    client = httpx.Client(transport=RecordingTransport(sqlite_store.run("abandoned")))
    body = {"model": "canned-model", "messages": [{"role": "user", "content": "hang"}],
            "stream": True}
    with client.stream("POST", f"{canned_upstream.url}/chat/completions", json=body) as response:
        first = next(response.iter_raw())
        assert first.startswith(b"data: ")
    canned_upstream.release.set()
    step = sqlite_store.show("abandoned")
    assert step.kind == "model_call"
    assert step.meta["extra"]["http"]["complete"] is False


def test_other_requests_become_http_steps_without_secrets(sqlite_store, canned_upstream):
    client = httpx.Client(transport=RecordingTransport(sqlite_store.run("http"),
                                                       redact_headers=["X-Team-Token"]))
    response = client.post(f"{canned_upstream.url}/embeddings?api_key={SECRET_KEY}&page=2",
                           json={"input": "hello"},
                           headers={"Authorization": f"Bearer {SECRET_KEY}",
                                    "X-Team-Token": SECRET_KEY, "Cookie": f"s={SECRET_KEY}"})
    assert response.status_code == 200
    step = sqlite_store.show("http")
    assert step.kind == "http"
    assert step.content["method"] == "POST" and step.content["status"] == 200
    assert step.content["url"].endswith("/v1/embeddings?api_key=[redacted]&page=2")
    assert step.content["request_headers"]["authorization"] == "[redacted]"
    assert step.content["request_headers"]["x-team-token"] == "[redacted]"
    assert json.loads(step.content["request_body"]) == {"input": "hello"}
    assert step.content["response_body"].startswith(b'{"object":"list"')
    secret = SECRET_KEY.encode()
    assert not any(secret in blob for blob in all_blob_bytes(sqlite_store))
    assert not any(SECRET_KEY in meta for meta in all_step_meta(sqlite_store))


def test_replay_none_serves_recorded_answers_offline_streams_included(
    store, canned_upstream
):
    run = store.run("agent")
    recorder = sdk(canned_upstream.url, RecordingTransport(run))
    assert run_weather_agent(recorder) == "It is sunny in Paris."
    streamed = recorder.chat.completions.create(model="canned-model", messages=QUESTION,
                                                stream=True)
    recorded_text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    canned_upstream.stop()  # offline from here on
    offline = sdk("http://127.0.0.1:9/v1", ReplayTransport(store.run("agent")))
    assert run_weather_agent(offline) == "It is sunny in Paris."
    replayed = offline.chat.completions.create(model="canned-model", messages=QUESTION,
                                               stream=True)
    chunks = [c for c in replayed if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == recorded_text
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    assert len(store.path("agent")) == 3  # nothing new recorded


def test_replay_none_answers_404_naming_the_closest_request_and_the_difference(
    sqlite_store, canned_upstream
):
    run_weather_agent(sdk(canned_upstream.url, RecordingTransport(sqlite_store.run("agent"))))
    client = httpx.Client(transport=ReplayTransport(sqlite_store.run("agent")))
    changed = [QUESTION[0], {"role": "user", "content": "Weather in Rome?"}]
    response = client.post(f"{canned_upstream.url}/chat/completions",
                           json={"model": "canned-model", "messages": changed, "tools": TOOLS,
                                 "temperature": 0})
    assert response.status_code == 404 and response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["code"] == "unrecorded_request"
    assert "POST /v1/chat/completions was not recorded" in error["message"]
    assert "messages[1]: recorded user: 'Weather in Paris?', request user: 'Weather in Rome?'" \
        in error["message"]


def test_replay_none_can_raise_for_direct_httpx_users(sqlite_store, canned_upstream):
    run_weather_agent(sdk(canned_upstream.url, RecordingTransport(sqlite_store.run("agent"))))
    transport = ReplayTransport(sqlite_store.run("agent"), on_unrecorded="raise")
    with pytest.raises(UnrecordedRequestError, match="/v1/models was not recorded"):
        httpx.Client(transport=transport).get(f"{canned_upstream.url}/models")
    with pytest.raises(UsageError, match="respond, raise"):
        ReplayTransport(sqlite_store.run("agent"), on_unrecorded="ignore")


@pytest.mark.parametrize("stream", [False, True])
def test_replay_none_through_the_sdk_shows_the_message_once_without_retrying(
    sqlite_store, canned_upstream, stream
):
    """Issue 23, item 12: not an `APIConnectionError` retried twice, but the message itself."""
    run_weather_agent(sdk(canned_upstream.url, RecordingTransport(sqlite_store.run("agent"))))
    seen: list[httpx.Request] = []
    transport = ReplayTransport(sqlite_store.run("agent"))
    counting = httpx.MockTransport(lambda request: (seen.append(request),
                                                    transport.handle_request(request))[1])
    client = openai.OpenAI(base_url=canned_upstream.url, api_key=SECRET_KEY,  # retries on
                           http_client=httpx.Client(transport=counting))
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="canned-model", messages=QUESTION, temperature=0.5,
                                       tools=TOOLS, stream=stream)
    assert len(seen) == 1
    assert "params temperature=0 (request: 0.5)" in caught.value.message
    assert caught.value.code == "unrecorded_request"


def test_async_replay_none_answers_404_too(sqlite_store, canned_upstream):
    run_weather_agent(sdk(canned_upstream.url, RecordingTransport(sqlite_store.run("agent"))))

    async def main() -> httpx.Response:
        transport = AsyncReplayTransport(sqlite_store.run("agent"))
        async with httpx.AsyncClient(transport=transport) as client:
            return await client.get(f"{canned_upstream.url}/models")

    response = asyncio.run(main())
    assert response.status_code == 404
    assert "/v1/models was not recorded" in response.json()["error"]["message"]


def test_replay_new_episodes_records_what_is_new_and_serves_what_is_recorded(
    store, canned_upstream
):
    run_weather_agent(sdk(canned_upstream.url, RecordingTransport(store.run("agent"))))
    served_before = len(canned_upstream.seen)
    client = sdk(canned_upstream.url, ReplayTransport(store.run("agent"),
                                                      mode="new_episodes"))
    run_weather_agent(client)
    assert len(canned_upstream.seen) == served_before  # both answered from the recording
    client.models.list()
    assert len(canned_upstream.seen) == served_before + 1
    assert [s.kind for s in store.path("agent")] == ["model_call", "model_call", "http"]


def test_replay_all_goes_live_and_records_again(sqlite_store, canned_upstream):
    run_weather_agent(sdk(canned_upstream.url, RecordingTransport(sqlite_store.run("agent"))))
    run_weather_agent(sdk(canned_upstream.url, ReplayTransport(sqlite_store.run("agent"),
                                                               mode="all")))
    assert len(sqlite_store.path("agent")) == 4


def test_an_unknown_replay_mode_is_a_usage_error(sqlite_store):
    with pytest.raises(UsageError, match="new_episodes"):
        ReplayTransport(sqlite_store.run("agent"), mode="once")


def test_async_twins_record_and_replay_streams(store, canned_upstream):
    async def agent(transport: httpx.AsyncBaseTransport) -> str:
        client = openai.AsyncOpenAI(base_url=canned_upstream.url, api_key=SECRET_KEY,
                                    max_retries=0,
                                    http_client=httpx.AsyncClient(transport=transport))
        stream = await client.chat.completions.create(model="canned-model", messages=QUESTION,
                                                      stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        plain = await client.chat.completions.create(model="canned-model", messages=QUESTION)
        return text + "|" + plain.choices[0].message.tool_calls[0].function.name

    recorded = asyncio.run(agent(AsyncRecordingTransport(store.run("async"))))
    assert recorded == "Let me check.|get_weather"
    canned_upstream.stop()
    replayed = asyncio.run(agent(AsyncReplayTransport(store.run("async"))))
    assert replayed == recorded
    assert [s.meta["extra"]["http"]["stream"] for s in store.path("async")] == [True, False]
