"""`kvtrace serve --upstream URL`: forwards to a second real server on loopback, returns its
bytes unchanged (streams as they arrive), and records the exchange."""

from __future__ import annotations

import httpx
import openai

from tests.canned import (
    CANNED_COMPLETION,
    CANNED_STREAM,
    SECRET_KEY,
    all_blob_bytes,
    all_step_meta,
)
from tests.serve.conftest import SERVER_KEY

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_completion_comes_back_byte_for_byte_and_is_recorded(
    store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(store, canned_upstream.url, run="proxied")
    response = httpx.post(f"{proxy.url}/chat/completions",
                          json={"model": "canned-model", "messages": QUESTION},
                          headers={"Authorization": f"Bearer {SECRET_KEY}"})
    assert response.status_code == 200
    assert response.content == CANNED_COMPLETION
    assert canned_upstream.seen[-1]["headers"]["authorization"] == f"Bearer {SECRET_KEY}"
    step = store.show("proxied")
    assert step.kind == "model_call"
    assert step.content["response"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert step.meta["usage"]["cached_tokens"] == 32
    assert not any(SECRET_KEY.encode() in blob for blob in all_blob_bytes(store))
    assert not any(SECRET_KEY in meta for meta in all_step_meta(store))


def test_a_stream_comes_back_byte_for_byte_and_is_recorded_assembled(
    store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(store, canned_upstream.url, run="streamed")
    body = {"model": "canned-model", "messages": QUESTION, "stream": True}
    with httpx.stream("POST", f"{proxy.url}/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        received = b"".join(response.iter_raw())
    assert received == b"".join(CANNED_STREAM)
    step = store.show("streamed")
    assert step.content["response"]["content"] == "Let me check."
    assert step.content["response"]["tool_calls"][0]["function"]["arguments"] == (
        '{"city": "Oslo"}')
    assert step.meta["extra"]["http"] == {
        "url": f"{canned_upstream.url}/chat/completions", "status": 200, "stream": True,
        "complete": True}


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


def test_bad_input_is_refused_before_forwarding(sqlite_store, canned_upstream, serve_upstream):
    proxy = serve_upstream(sqlite_store, canned_upstream.url, run="bad")
    response = httpx.post(f"{proxy.url}/chat/completions", json={"model": "canned-model"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert canned_upstream.seen == [] and sqlite_store.runs() == []


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
