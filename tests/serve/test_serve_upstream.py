"""`kvtrace serve --upstream URL`: forwards to a second real server on loopback, returns its
bytes unchanged (streams as they arrive), and records the exchange."""

from __future__ import annotations

import httpx
import openai

from tests.canned import (
    SECRET_KEY,
    all_blob_bytes,
)
from tests.serve.conftest import SERVER_KEY

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def test_upstream_completions_become_model_call_steps_plain_and_streamed(
    store, canned_upstream, serve_upstream
):
    """Its bytes come back unchanged (the contract suite); here, what the step holds."""
    proxy = serve_upstream(store, canned_upstream.url, run="proxied")
    body = {"model": "canned-model", "messages": QUESTION}
    assert httpx.post(f"{proxy.url}/chat/completions", json=body).status_code == 200
    with httpx.stream("POST", f"{proxy.url}/chat/completions",
                      json={**body, "stream": True}) as response:
        response.read()
    plain, streamed = store.path("proxied")
    assert plain.content["response"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert plain.meta["usage"]["cached_tokens"] == 32
    assert streamed.content["response"]["content"] == "Let me check."
    assert streamed.content["response"]["tool_calls"][0]["function"]["arguments"] == (
        '{"city": "Oslo"}')


def test_kvtrace_local_as_upstream_with_the_sdk_plain_and_streaming(
    sqlite_store, serve_local, serve_upstream, tiny_engine, tmp_path
):
    from kvtrace import open_store

    upstream_store = open_store(f"sqlite:///{tmp_path / 'upstream.db'}")
    upstream = serve_local(upstream_store, run="upstream-side")
    proxy = serve_upstream(sqlite_store, upstream.url, run="proxy-side")
    sdk = openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    plain = sdk.chat.completions.create(model=tiny_engine.name, messages=messages, max_tokens=5)
    stream = sdk.chat.completions.create(model=tiny_engine.name, messages=messages, max_tokens=5,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the upstream's cache
    proxied, upstream_side = sqlite_store.path("proxy-side"), upstream_store.path("upstream-side")
    assert [s.content["response"] for s in proxied] == [
        s.content["response"] for s in upstream_side]
    assert [s.meta["usage"]["cached_tokens"] for s in proxied] == [
        s.meta["usage"]["cached_tokens"] for s in upstream_side]
    assert sdk.models.list().data[0].id == tiny_engine.name
    upstream_store.close()


def test_an_upstream_4xx_comes_back_unchanged_and_records_nothing(
    sqlite_store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(sqlite_store, canned_upstream.url, run="errors")
    response = httpx.post(f"{proxy.url}/chat/completions",
                          json={"model": "missing", "messages": QUESTION})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert sqlite_store.runs() == []


def test_other_endpoints_are_forwarded_and_recorded_as_http_steps(
    store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(store, canned_upstream.url, run="other")
    response = httpx.post(f"{proxy.url}/embeddings", json={"input": "x"},
                          headers={"x-api-key": SECRET_KEY})
    assert response.json()["data"][0]["embedding"] == [0.5]
    step = store.show("other")
    assert step.kind == "http" and step.content["request_headers"]["x-api-key"] == "[redacted]"


def test_with_its_own_key_the_server_sends_the_upstream_key_instead(
    sqlite_store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(sqlite_store, canned_upstream.url, run="keys", api_key=SERVER_KEY,
                           upstream_api_key=SECRET_KEY)
    sdk = openai.OpenAI(base_url=proxy.url, api_key=SERVER_KEY, max_retries=0)
    sdk.chat.completions.create(model="canned-model", messages=QUESTION)
    assert canned_upstream.seen[-1]["headers"]["authorization"] == f"Bearer {SECRET_KEY}"
    for secret in (SECRET_KEY, SERVER_KEY):
        assert not any(secret.encode() in blob for blob in all_blob_bytes(sqlite_store))


def test_an_unreachable_upstream_is_a_502_with_an_openai_error(sqlite_store, serve_upstream):
    proxy = serve_upstream(sqlite_store, "http://127.0.0.1:9/v1", run="down")
    response = httpx.post(f"{proxy.url}/chat/completions",
                          json={"model": "m", "messages": QUESTION})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unreachable"
    assert sqlite_store.runs() == []


def test_a_path_with_encoded_control_characters_is_forwarded_as_sent(
    sqlite_store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(sqlite_store, canned_upstream.url, run="paths")  # found by the fuzz
    response = httpx.get(f"{proxy.url}/files%1Cx%F2%8E")  # test: decoded, it was a 500
    assert response.status_code == 200
    assert canned_upstream.seen[-1]["path"] == "/v1/files%1Cx%F2%8E"
