"""`kvtrace serve` in local mode, driven by the official openai SDK over a loopback socket."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from kvtrace.replay import LocalBackend
from kvtrace.replay.oracle import common_prefix_length
from kvtrace.store.kinds import TOKEN_IDS_KEY
from tests.canned import all_blob_bytes, all_step_meta
from tests.serve.conftest import SERVER_KEY

SYSTEM = {"role": "system", "content": "You are a terse assistant. " * 8}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
}}]


def client(server, key: str = SERVER_KEY, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, **options)


def test_plain_streaming_and_tool_calling_requests_are_answered_and_recorded(
    store, serve_local, tiny_engine
):
    server = serve_local(store, run="sdk", api_key=SERVER_KEY)
    sdk = client(server)
    model = sdk.models.list().data[0].id
    messages = [SYSTEM, {"role": "user", "content": "Say hi."}]
    plain = sdk.chat.completions.create(model=model, messages=messages, max_tokens=6)
    assert plain.choices[0].message.role == "assistant"
    assert plain.usage.completion_tokens == 6 and plain.choices[0].finish_reason == "length"
    stream = sdk.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content  # greedy: the same answer
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    with_tools = [*messages, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": '{"word": "hi"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a greeting"}]
    tooled = sdk.chat.completions.create(model=model, messages=with_tools, tools=TOOLS,
                                         tool_choice="auto", max_tokens=6)
    assert tooled.choices[0].finish_reason in ("length", "stop", "tool_calls")
    steps = store.path("sdk")
    assert [s.kind for s in steps] == ["model_call"] * 3
    assert steps[0].content["response"]["content"] == plain.choices[0].message.content
    assert steps[1].meta["extra"]["http"]["stream"] is True
    assert steps[2].content["tools"] == TOOLS
    assert steps[2].content["messages"][-1]["tool_call_id"] == "call_1"
    assert steps[2].meta["params"] == {"tool_choice": "auto", "max_tokens": 6}
    assert len(steps[2].meta["usage"][TOKEN_IDS_KEY]) == 6


def test_a_second_request_sharing_a_prefix_reports_the_reused_tokens_as_cached(
    sqlite_store, serve_local, tiny_engine
):
    server = serve_local(sqlite_store, run="prefix")
    sdk = client(server)
    first_messages = [SYSTEM, {"role": "user", "content": "First question?"}]
    first = sdk.chat.completions.create(model=tiny_engine.name, messages=first_messages,
                                        max_tokens=5)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second_messages = [*first_messages, first.choices[0].message.model_dump(exclude_none=True),
                       {"role": "user", "content": "And a second one?"}]
    second = sdk.chat.completions.create(model=tiny_engine.name, messages=second_messages,
                                         max_tokens=5)
    step = sqlite_store.path("prefix")[0]
    cached_sequence = tiny_engine.chat_tokens(first_messages) + step.meta["usage"][TOKEN_IDS_KEY]
    prompt = tiny_engine.chat_tokens(second_messages)
    expected = min(common_prefix_length(prompt, cached_sequence), len(prompt) - 1)
    assert expected > 60
    assert second.usage.prompt_tokens == len(prompt)
    assert second.usage.prompt_tokens_details.cached_tokens == expected


def test_no_blob_holds_the_bearer_token_or_api_keys(sqlite_store, serve_local, tiny_engine,
                                                    tmp_path):
    server = serve_local(sqlite_store, run="secrets", api_key=SERVER_KEY,
                         redact_headers=("X-Org-Secret",))
    response = httpx.post(f"{server.url}/chat/completions", headers={
        "Authorization": f"Bearer {SERVER_KEY}", "api-key": SERVER_KEY,
        "x-api-key": SERVER_KEY, "Cookie": f"session={SERVER_KEY}",
        "X-Org-Secret": SERVER_KEY},
        json={"model": tiny_engine.name, "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 3, "api_key": SERVER_KEY, "metadata": {"password": SERVER_KEY}})
    assert response.status_code == 200
    assert len(sqlite_store.path("secrets")) == 1
    assert sqlite_store.path("secrets")[0].meta["params"]["metadata"] == {"password": "[redacted]"}
    secret = SERVER_KEY.encode()
    assert not any(secret in blob for blob in all_blob_bytes(sqlite_store))
    assert not any(SERVER_KEY in meta for meta in all_step_meta(sqlite_store))
    for path in tmp_path.glob("store.db*"):  # the database files themselves, WAL included
        assert secret not in path.read_bytes()


BAD_INPUTS = [
    ("malformed JSON", b'{"model": "x", "messages": [', 400, None),
    ("missing messages", {"model": "MODEL"}, 400, "messages"),
    ("messages not a list", {"model": "MODEL", "messages": "hi"}, 400, "messages"),
    ("a message without a role", {"model": "MODEL", "messages": [{"content": "hi"}]}, 400,
     "messages"),
    ("temperature a string", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                              "temperature": "hot"}, 400, "temperature"),
    ("max_tokens zero", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                         "max_tokens": 0}, 400, "max_tokens"),
    ("a seed past 64 bits", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                             "temperature": 0.5, "seed": -(2**109)}, 400, "seed"),
    ("n of two", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "n": 2},
     400, "n"),
    ("tools not a list", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                          "tools": {"name": "f"}}, 400, "tools"),
    ("a prompt longer than the context", {"model": "MODEL", "messages": [
        {"role": "user", "content": "word " * 9000}]}, 400, "messages"),
]


@pytest.mark.parametrize(("case", "body", "status", "param"), BAD_INPUTS,
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_a_4xx_with_an_openai_error_body_and_records_nothing(
    sqlite_store, serve_local, tiny_engine, case, body, status, param
):
    server = serve_local(sqlite_store, run="bad")
    if isinstance(body, dict):
        body = json.dumps({**body, "model": tiny_engine.name} if body["model"] == "MODEL"
                          else body).encode()
    response = httpx.post(f"{server.url}/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert sqlite_store.runs() == []


def test_any_model_name_is_answered_by_the_local_model_and_both_names_are_recorded(
    store, serve_local, tiny_engine
):
    from kvtrace.store.kinds import ModelCall

    server = serve_local(store, run="any")
    reply = client(server).chat.completions.create(
        model="gpt-9", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert reply.model == tiny_engine.name  # the model that answered says so
    call = ModelCall(store.show("any"))
    assert call.model == tiny_engine.name and call.request_model == "gpt-9"


def test_with_strict_model_another_name_is_a_404_and_records_nothing(sqlite_store, serve_local,
                                                                      tiny_engine):
    server = serve_local(sqlite_store, run="strict", strict_model=True)
    response = httpx.post(f"{server.url}/chat/completions", json={
        "model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert sqlite_store.runs() == []
    schema = httpx.get(server.url.removesuffix("/v1") + "/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["properties"]["model"] == {
        "enum": [tiny_engine.name]}


def test_a_body_over_the_size_limit_is_a_413_and_records_nothing(sqlite_store, serve_local,
                                                                 tiny_engine):
    server = serve_local(sqlite_store, run="big", max_body_bytes=1000)
    body = {"model": tiny_engine.name, "messages": [{"role": "user", "content": "x" * 2000}]}
    response = httpx.post(f"{server.url}/chat/completions", json=body)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert sqlite_store.runs() == []


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {SERVER_KEY}"])
def test_a_missing_or_wrong_bearer_token_is_a_401(sqlite_store, serve_local, tiny_engine,
                                                  authorization):
    server = serve_local(sqlite_store, run="auth", api_key=SERVER_KEY)
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.post(f"{server.url}/chat/completions", headers=headers, json={
        "model": tiny_engine.name, "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert sqlite_store.runs() == []
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong-key").models.list()


def test_the_run_header_picks_the_run_and_a_bad_name_is_a_400(sqlite_store, serve_local,
                                                              tiny_engine):
    server = serve_local(sqlite_store)
    sdk = client(server, default_headers={"X-Kvtrace-Run": "chosen"})
    sdk.chat.completions.create(model=tiny_engine.name, max_tokens=2,
                                messages=[{"role": "user", "content": "x"}])
    assert [info.name for info in sqlite_store.runs()] == ["chosen"]
    assert server.server.default_run.startswith("serve-")
    bad = httpx.post(f"{server.url}/chat/completions", headers={"X-Kvtrace-Run": "a..b"},
                     json={"model": tiny_engine.name,
                           "messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 400 and "run name" in bad.json()["error"]["message"]


def test_past_the_queue_a_request_gets_429_not_a_crash(sqlite_store, serve_local, tiny_engine):
    server = serve_local(sqlite_store, run="queue", max_queue=0)
    long_request = {"model": tiny_engine.name, "max_tokens": 1500, "temperature": 0,
                    "messages": [{"role": "user", "content": "Write a long story."}]}
    results: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: results.append(
        httpx.post(f"{server.url}/chat/completions", json=long_request, timeout=600)))
    worker.start()
    health = server.url.removesuffix("/v1") + "/health"
    while worker.is_alive() and httpx.get(health).json()["queue"]["running"] == 0:
        time.sleep(0.01)  # wait until the engine is busy (a wait, not a timed assertion)
    assert worker.is_alive(), "the long request ended before the engine was seen busy"
    refused = httpx.post(f"{server.url}/chat/completions", json={
        **long_request, "max_tokens": 2})
    worker.join()
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert results[0].status_code == 200
    assert len(sqlite_store.path("queue")) == 1


def test_health_and_models(sqlite_store, serve_local, tiny_engine):
    server = serve_local(sqlite_store, run="h")
    health = httpx.get(server.url.removesuffix("/v1") + "/health").json()
    assert health["status"] == "ok" and health["mode"] == "local" and health["run"] == "h"
    assert health["dtype"] == "float32"
    models = httpx.get(f"{server.url}/models").json()
    assert [m["id"] for m in models["data"]] == [tiny_engine.name]
    missing = httpx.get(f"{server.url}/embeddings")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert "POST /v1/messages" in missing.json()["error"]["message"]


def _weather_call(city: str, call_id: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}]}


WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
FEW_SHOT = [
    {"role": "user", "content": "Weather in Paris?"}, _weather_call("Paris", "call_1"),
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny in Paris."},
    {"role": "user", "content": "Weather in Rome?"}, _weather_call("Rome", "call_2"),
    {"role": "tool", "tool_call_id": "call_2", "content": "rainy"},
    {"role": "assistant", "content": "It is rainy in Rome."},
    {"role": "user", "content": "Weather in Oslo?"},
]


@pytest.fixture(scope="module")
def default_model_engine():
    from kvtrace.engine import load_engine
    from kvtrace.paths import default_cache_dir

    return load_engine(None, cache_dir=default_cache_dir())


@pytest.mark.slow
def test_the_default_model_calls_a_tool_and_the_sdk_gets_tool_calls(
    sqlite_store, tmp_path, default_model_engine
):
    from kvtrace.engine import KVCache
    from kvtrace.serve import BackgroundServer, make_server

    backend = LocalBackend(default_model_engine,
                           KVCache(default_model_engine, disk_dir=tmp_path / "kv"))
    server = make_server(backend=backend, store=sqlite_store, run="tools")
    with BackgroundServer(server.app) as running:
        sdk = client(running)
        reply = sdk.chat.completions.create(model=default_model_engine.name, messages=FEW_SHOT,
                                            tools=WEATHER_TOOLS, max_tokens=40)
        stream = sdk.chat.completions.create(model=default_model_engine.name, messages=FEW_SHOT,
                                             tools=WEATHER_TOOLS, max_tokens=40, stream=True)
        chunks = [c for c in stream if c.choices]
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert streamed[0].id == call.id and streamed[0].function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    recorded = sqlite_store.path("tools")
    assert [s.content["response"]["tool_calls"][0]["function"]["name"] for s in recorded] == [
        "get_weather", "get_weather"]
    assert recorded[1].meta["usage"]["cached_tokens"] > 0  # the second prompt hit the first


def test_a_run_recorded_by_the_server_replays_offline_through_replay_transport(
    store, serve_local, tiny_engine
):
    from kvtrace.tracer import ReplayTransport

    server = serve_local(store, run="served")
    messages = [SYSTEM, {"role": "user", "content": "Hello?"}]
    live = client(server).chat.completions.create(model=tiny_engine.name, messages=messages,
                                                  max_tokens=4, temperature=0.7)
    offline = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0,
                            http_client=httpx.Client(transport=ReplayTransport(
                                store.run("served"))))
    again = offline.chat.completions.create(model=tiny_engine.name, messages=messages,
                                            max_tokens=4, temperature=0.7)
    assert again.choices[0].message.content == live.choices[0].message.content
    assert again.usage.prompt_tokens == live.usage.prompt_tokens
    step = store.show("served")
    assert isinstance(step.meta["params"]["seed"], int)  # chosen by the server, recorded


def test_tokenize_gives_the_prompt_ids_the_engine_renders(sqlite_store, serve_local,
                                                          tiny_engine):
    """POST /tokenize (vLLM's shape): what benchmarks compare a peer's tokens with."""
    server = serve_local(sqlite_store, run="tok")
    root = server.url.removesuffix("/v1")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({}, {"add_generation_prompt": True}, {"tools": tools}):
        reply = httpx.post(f"{root}/tokenize", json={"model": "any", "messages": messages,
                                                     **extra})
        assert reply.status_code == 200
        expected = tiny_engine.chat_tokens(messages, tools=extra.get("tools"))
        assert reply.json() == {"count": len(expected), "tokens": expected,
                                "max_model_len": tiny_engine.max_context_tokens}
    # Closed by the template, no generation prompt: the ids replay reads an output's from.
    answered = [*messages, {"role": "assistant", "content": "Hello."}]
    closed = httpx.post(f"{root}/tokenize", json={"messages": answered,
                                                  "add_generation_prompt": False})
    expected = tiny_engine.chat_tokens(answered, add_generation_prompt=False)
    assert closed.status_code == 200 and closed.json()["tokens"] == expected
    assert expected != tiny_engine.chat_tokens(answered)  # the generation prompt is left out
    # Past the model's context: tokenised all the same, as vLLM's is (a replay stops itself).
    long = [{"role": "user", "content": "colour " * (tiny_engine.max_context_tokens or 4096)}]
    past = httpx.post(f"{root}/tokenize", json={"messages": long})
    assert past.status_code == 200 and past.json()["count"] == len(
        tiny_engine.chat_tokens(long)) > (tiny_engine.max_context_tokens or 4096)
    text = httpx.post(f"{root}/detokenize", json={"tokens": expected})
    assert text.json() == {"prompt": tiny_engine.decode(expected, skip_special_tokens=False)}
    # Bad input: a clear 4xx, nothing recorded.
    for path, body, param in (
        ("/tokenize", {"model": "any", "messages": messages, "add_generation_prompt": "yes"},
         "add_generation_prompt"),
        ("/tokenize", {"model": "any"}, "messages"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [tiny_engine.vocab_size]}, "tokens"),
    ):
        refused = httpx.post(f"{root}{path}", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert sqlite_store.runs() == [] or all(r.name != "tok" for r in sqlite_store.runs())
