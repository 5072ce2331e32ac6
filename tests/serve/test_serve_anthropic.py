"""`kvtrace serve` speaks the Anthropic Messages API, driven by the official `anthropic` SDK.

Local mode: a tiny random model (and, marked slow, the default model for
tool calls), real stores on SQLite and PostgreSQL, real loopback sockets.
Upstream mode: tests/serve/canned_proxied.py behind the server.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from kvtrace.apis import ProviderApi
from kvtrace.store.kinds import ModelCall
from tests.serve.conftest import SERVER_KEY

ASKED = "claude-sonnet-4-5"  # a name an unchanged agent sends; the local model answers it
SYSTEM = "You are a terse assistant. " * 8
QUESTION = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"name": "lookup", "description": "Look a word up", "input_schema": {
    "type": "object", "properties": {"word": {"type": "string"}}}}]
AFTER_A_TOOL = [*QUESTION,
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                   "name": "lookup", "input": {"word": "hi"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": "a greeting"}]}]


def client(server, key: str = SERVER_KEY, **options) -> anthropic.Anthropic:
    """The SDK pointed at the server as ANTHROPIC_BASE_URL would: the base URL without /v1."""
    return anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=key,
                               max_retries=0, **options)


def post(server, body, **headers) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}/messages", content=data, timeout=120,
                      headers={"content-type": "application/json", **headers})


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """The body is Anthropic's error shape; its message."""
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    return str(body["error"]["message"])


# -- local mode --------------------------------------------------------------------------------


def test_plain_streamed_and_tool_requests_are_answered_in_the_messages_shape_and_recorded(
    store, serve_local, tiny_engine
):
    server = serve_local(store, run="claude", api_key=SERVER_KEY)
    sdk = client(server)
    plain = sdk.messages.create(model=ASKED, max_tokens=6, system=SYSTEM, messages=QUESTION)
    [block] = plain.content
    assert plain.type == "message" and plain.role == "assistant" and block.type == "text"
    assert plain.stop_reason == "max_tokens" and plain.usage.output_tokens == 6
    prompt = tiny_engine.chat_tokens([{"role": "system", "content": SYSTEM}, *QUESTION])
    assert plain.usage.input_tokens + plain.usage.cache_read_input_tokens == len(prompt)
    assert plain.usage.cache_creation_input_tokens == 0
    events = list(sdk.messages.create(model=ASKED, max_tokens=6, system=SYSTEM,
                                      messages=QUESTION, stream=True))
    kinds = [event.type for event in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert events[2].delta.text == block.text  # greedy: the same answer
    started = events[0].message.usage
    assert started.cache_read_input_tokens == len(prompt) - 1  # all but the prompt's last token
    assert started.input_tokens == 1
    assert events[4].delta.stop_reason == "max_tokens" and events[4].usage.output_tokens == 6
    tooled = sdk.messages.create(model=ASKED, max_tokens=6, system=SYSTEM,
                                 messages=AFTER_A_TOOL, tools=TOOLS, tool_choice={"type": "auto"})
    assert tooled.stop_reason in ("max_tokens", "end_turn", "tool_use")
    calls = [ModelCall(step) for step in store.path("claude")]
    assert [call.api for call in calls] == [ProviderApi.ANTHROPIC_MESSAGES] * 3
    assert [call.model for call in calls] == [tiny_engine.name] * 3
    assert [call.request_model for call in calls] == [ASKED] * 3
    assert calls[0].native["system"] == SYSTEM
    assert calls[0].native["response"]["content"] == [{"type": "text", "text": block.text}]
    assert calls[0].response == {"role": "assistant", "content": block.text}  # the chat view
    assert calls[1].http == {"url": f"{server.url}/messages", "status": 200, "stream": True,
                             "complete": True}
    assert calls[1].usage.prompt_tokens == len(prompt)
    assert calls[1].usage.cached_tokens == len(prompt) - 1
    assert calls[1].usage.cache_write_tokens == 0
    assert calls[2].native["tools"] == TOOLS
    assert calls[2].messages[-1] == {"role": "tool", "tool_call_id": "toolu_1",
                                     "content": "a greeting"}
    assert calls[2].params == {"max_tokens": 6, "tool_choice": {"type": "auto"}}
    assert len(calls[2].output_ids or []) == tooled.usage.output_tokens


def test_the_stream_helper_assembles_the_same_message(sqlite_store, serve_local):
    server = serve_local(sqlite_store, run="helper")
    sdk = client(server)
    plain = sdk.messages.create(model=ASKED, max_tokens=5, messages=QUESTION)
    with sdk.messages.stream(model=ASKED, max_tokens=5, messages=QUESTION) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_count_tokens_is_the_rendered_prompt_s_length_and_records_nothing(
    sqlite_store, serve_local, tiny_engine
):
    server = serve_local(sqlite_store, run="counted")
    counted = client(server).messages.count_tokens(model=ASKED, system=SYSTEM,
                                                   messages=QUESTION)
    prompt = tiny_engine.chat_tokens([{"role": "system", "content": SYSTEM}, *QUESTION])
    assert counted.input_tokens == len(prompt)
    assert sqlite_store.runs() == []


def test_a_run_recorded_by_the_server_replays_offline_through_replay_transport(
    store, serve_local
):
    import httpx2

    from kvtrace.tracer import ReplayTransport

    server = serve_local(store, run="served")
    request = {"model": ASKED, "max_tokens": 5, "system": SYSTEM, "messages": AFTER_A_TOOL,
               "tools": TOOLS}
    live = client(server).messages.create(**request)
    live_events = list(client(server).messages.create(**request, stream=True))
    offline = anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="x", max_retries=0,
                                  http_client=httpx2.Client(
                                      transport=ReplayTransport(store.run("served"))))
    again = offline.messages.create(**request)
    # the step alone rebuilds the answer (its usage also carries kvtrace's token ids)
    assert again.model_dump(exclude={"usage"}) == live.model_dump(exclude={"usage"})
    counts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens",
              "output_tokens")
    assert [getattr(again.usage, n) for n in counts] == [getattr(live.usage, n) for n in counts]
    again_events = list(offline.messages.create(**request, stream=True))
    assert [e.model_dump() for e in again_events] == [e.model_dump() for e in live_events]


BAD_INPUTS = [
    ("malformed JSON", b'{"model": "m", "messages": [', "not valid JSON"),
    ("missing max_tokens", {"model": "m", "messages": QUESTION}, "max_tokens"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("messages not a list", {"messages": "hi"}, "messages"),
    ("a block without a type", {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "content block"),
    ("a tool_use without an id", {"messages": [
        *QUESTION, {"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]},
     "needs id"),
    ("a tool_result with no tool_use", {"messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                      "content": "x"}]}]}, "answers no tool_use"),
    ("a tool_use input that is not an object", {"messages": [*QUESTION, {
        "role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                          "input": [1]}]}]}, "input must be an object"),
    ("a text block whose text is a number", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": 7}]}]}, "needs text"),
    ("a role of system", {"messages": [{"role": "system", "content": "x"}]}, "use user or"),
    ("temperature a string", {"temperature": "hot"}, "temperature"),
    ("temperature past 1", {"temperature": 1.5}, "temperature"),
    ("system a number", {"system": 3}, "system must be"),
    ("tools not a list", {"tools": {"name": "f"}}, "tools must be"),
    ("a tool's schema not an object", {"tools": [{"name": "f", "input_schema": "x"}]},
     "input_schema"),
    ("tool_choice a string", {"tool_choice": "auto"}, "tool_choice"),
    ("stop_sequences not strings", {"stop_sequences": [1]}, "stop_sequences"),
    ("NaN", b'{"model": "m", "max_tokens": 2, "temperature": NaN, "messages": '
     b'[{"role": "user", "content": "x"}]}', "finite"),
    ("a lone surrogate", {"messages": [{"role": "user", "content": "bad \ud800"}]},
     "surrogate"),
]


@pytest.mark.parametrize(("case", "body", "named"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_400_in_anthropic_s_error_shape_and_records_nothing(
    sqlite_store, serve_local, case, body, named
):
    store = sqlite_store
    server = serve_local(store, run="bad")
    if isinstance(body, dict) and case != "missing max_tokens":
        body = {"model": ASKED, "max_tokens": 4, "messages": QUESTION, **body}
    message = assert_anthropic_error(post(server, body), 400, "invalid_request_error")
    assert named in message
    assert store.runs() == []


def test_the_server_s_own_failures_are_in_anthropic_s_shape_too(sqlite_store, serve_local,
                                                                tiny_engine):
    server = serve_local(sqlite_store, run="shapes", api_key=SERVER_KEY, max_body_bytes=2000,
                         strict_model=True)
    body = {"model": tiny_engine.name, "max_tokens": 2, "messages": QUESTION}
    assert_anthropic_error(post(server, body), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        client(server, key="wrong-key").messages.create(**body)
    assert post(server, body, **{"x-api-key": SERVER_KEY}).status_code == 200  # its own header
    key = {"x-api-key": SERVER_KEY}
    too_big = {**body, "messages": [{"role": "user", "content": "x" * 3000}]}
    assert_anthropic_error(post(server, too_big, **key), 413, "request_too_large")
    other = {**body, "model": ASKED}
    assert "does not exist here" in assert_anthropic_error(post(server, other, **key), 404,
                                                           "not_found_error")
    text = httpx.post(f"{server.url}/messages", content=json.dumps(body), headers={
        "content-type": "text/plain", **key})
    assert_anthropic_error(text, 415, "invalid_request_error")
    assert len(sqlite_store.path("shapes")) == 1


def test_a_paused_run_is_a_409_the_sdk_raises_and_nothing_is_computed(store, serve_local):
    server = serve_local(store, run="watched")
    sdk = client(server)
    sdk.messages.create(model=ASKED, max_tokens=2, messages=QUESTION)
    store.pause("watched")
    with pytest.raises(anthropic.ConflictError, match="paused"):
        sdk.messages.create(model=ASKED, max_tokens=2, messages=QUESTION)
    assert len(store.path("watched")) == 1


@pytest.mark.slow
def test_the_default_model_calls_a_tool_and_the_sdk_gets_tool_use_blocks(sqlite_store, tmp_path):
    from kvtrace.engine import KVCache, load_engine
    from kvtrace.paths import default_cache_dir
    from kvtrace.replay import LocalBackend
    from kvtrace.serve import BackgroundServer, make_server

    engine = load_engine(None, cache_dir=default_cache_dir())
    tools = [{"name": "get_weather", "description": "Get the current weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}]

    def turn(city: str, number: int, weather: str) -> list[dict]:
        call = {"type": "tool_use", "id": f"toolu_{number}", "name": "get_weather",
                "input": {"city": city}}
        return [{"role": "user", "content": f"Weather in {city}?"},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{"type": "tool_result",
                                              "tool_use_id": f"toolu_{number}",
                                              "content": weather}]},
                {"role": "assistant", "content": f"It is {weather} in {city}."}]

    few_shot = [*turn("Paris", 1, "sunny"), *turn("Rome", 2, "rainy"),
                {"role": "user", "content": "Weather in Oslo?"}]
    backend = LocalBackend(engine, KVCache(engine, disk_dir=tmp_path / "kv"))
    server = make_server(backend=backend, store=sqlite_store, run="tools")
    with BackgroundServer(server.app) as running:
        sdk = client(running)
        reply = sdk.messages.create(model=ASKED, max_tokens=40, messages=few_shot, tools=tools)
        with sdk.messages.stream(model=ASKED, max_tokens=40, messages=few_shot,
                                 tools=tools) as stream:
            streamed = stream.get_final_message()
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and use.id.startswith("toolu_")
    assert use.name == "get_weather" and use.input == {"city": "Oslo"}
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in reply.content]
    assert streamed.usage.cache_read_input_tokens > 0  # the second prompt hit the first
    recorded = [ModelCall(step) for step in sqlite_store.path("tools")]
    assert [call.response["tool_calls"][0]["function"]["name"] for call in recorded] == [
        "get_weather", "get_weather"]
    assert recorded[0].native["response"]["stop_reason"] == "tool_use"


# -- upstream mode -----------------------------------------------------------------------------


def test_upstream_messages_calls_become_model_call_steps(store, canned_apis, serve_upstream):
    proxy = serve_upstream(store, canned_apis.url, run="captured")
    sdk = client(proxy)
    sdk.messages.create(model="claude-canned", max_tokens=20, messages=QUESTION, tools=TOOLS)
    list(sdk.messages.create(model="claude-canned", max_tokens=20, messages=QUESTION,
                             stream=True))
    calls = [ModelCall(step) for step in store.path("captured")]
    assert [call.api for call in calls] == [ProviderApi.ANTHROPIC_MESSAGES] * 2
    assert calls[0].native["tools"] == TOOLS
    assert calls[0].response["tool_calls"][0]["function"]["name"] == "get_weather"
    assert calls[0].usage.cached_tokens == 30 and calls[0].usage.prompt_tokens == 62
    assert calls[1].response["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_with_its_own_key_the_server_sends_the_upstream_key_as_x_api_key(
    sqlite_store, canned_apis, serve_upstream
):
    proxy = serve_upstream(sqlite_store, canned_apis.url, run="keys", api_key=SERVER_KEY,
                           upstream_api_key="sk-ant-upstream")
    client(proxy).messages.create(model="claude-canned", max_tokens=5, messages=QUESTION)
    headers = canned_apis.seen[-1]["headers"]
    assert headers["x-api-key"] == "sk-ant-upstream"
    assert SERVER_KEY not in json.dumps(headers)  # the server's own key is not forwarded


def test_a_stalled_upstream_stream_ends_with_an_error_event_the_sdk_raises(
    sqlite_store, canned_apis, serve_upstream
):
    proxy = serve_upstream(sqlite_store, canned_apis.url, run="stalled", upstream_timeout=0.5)
    stream = client(proxy).messages.create(
        model="claude-canned", max_tokens=5, stream=True,
        messages=[{"role": "user", "content": "hang"}])
    received = []
    with pytest.raises(anthropic.APIStatusError, match=r"sent nothing for 0\.5 s"):
        for event in stream:
            received.append(event.type)
    assert received == ["message_start", "content_block_start"]
    canned_apis.release.set()
