"""Hostile request bodies (issue 23, items 4, 6 and 11): each is a 4xx JSON error body sent
before any work, nothing is recorded, and the client's connection stays usable.

Every test runs a real server on a loopback port against a real store, on
SQLite and on PostgreSQL (the `store` fixture), in local mode (the tiny
random model) and, where the check is shared, in upstream mode too.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from kvtrace.store.objects.encoding import MAX_DEPTH

QUESTION = [{"role": "user", "content": "Say hi."}]


def chat_body(model: str, **fields) -> dict:
    return {"model": model, "messages": QUESTION, "max_tokens": 2, **fields}


def post_raw(http: httpx.Client, url: str, data: bytes,
             content_type: str = "application/json") -> httpx.Response:
    return http.post(f"{url}/chat/completions", content=data,
                     headers={"content-type": content_type}, timeout=120)


def nested(depth: int, leaf: str = "x") -> str:
    """JSON text of a list nested `depth` deep (the innermost holds `leaf`)."""
    return "[" * depth + json.dumps(leaf) + "]" * depth


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_connection_still_answers(http: httpx.Client, url: str, model: str) -> None:
    """The next request on the same kept-alive connection is answered, not reset."""
    response = http.post(f"{url}/chat/completions", json=chat_body(model), timeout=120)
    assert response.status_code == 200, response.text[:500]


NON_FINITE = [
    ("NaN temperature", b'"temperature": NaN'),
    ("Infinity temperature", b'"temperature": Infinity'),
    ("-Infinity top_p", b'"top_p": -Infinity'),
    ("a float past the double range", b'"temperature": 1e400'),
    ("NaN in an unchecked field", b'"metadata": {"score": NaN}'),
]


@pytest.mark.parametrize(("case", "field"), NON_FINITE, ids=[c[0] for c in NON_FINITE])
def test_a_number_that_is_not_finite_is_a_400_before_any_work(store, serve_local, tiny_engine,
                                                              case, field):
    server = serve_local(store, run="finite")
    data = (b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], '
            % tiny_engine.name.encode() + field + b"}")
    with httpx.Client() as http:
        error = assert_error(post_raw(http, server.url, data), 400, "invalid_value")
        assert "finite" in error["message"]
        assert_connection_still_answers(http, server.url, tiny_engine.name)
    assert [s.kind for s in store.path("finite")] == ["model_call"]  # the good request only


def test_a_hundred_thousand_nested_brackets_are_a_400_not_a_recursion_error(
    store, serve_local, tiny_engine
):
    server = serve_local(store, run="deep")
    with httpx.Client() as http:
        error = assert_error(post_raw(http, server.url, b"[" * 100_000), 400, "invalid_value")
        assert "nested" in error["message"]
        assert_connection_still_answers(http, server.url, tiny_engine.name)
    assert len(store.path("deep")) == 1


@pytest.mark.parametrize("where", ["content", "metadata"])
def test_a_value_nested_past_what_the_store_keeps_is_a_400_before_any_work(
    store, serve_local, tiny_engine, where
):
    server = serve_local(store, run="deep")
    inner = nested(900)
    if where == "content":
        text = (f'{{"model": "{tiny_engine.name}", "messages": [{{"role": "user", "content": '
                f'[{{"type": "text", "text": "x", "extra": {inner}}}]}}]}}')
    else:
        text = (f'{{"model": "{tiny_engine.name}", "messages": [{{"role": "user", '
                f'"content": "x"}}], "metadata": {inner}}}')
    with httpx.Client() as http:
        error = assert_error(post_raw(http, server.url, text.encode()), 400, "invalid_value")
        assert "nested more than" in error["message"]
        assert_connection_still_answers(http, server.url, tiny_engine.name)
    assert len(store.path("deep")) == 1


def test_a_body_nested_right_up_to_the_limit_is_answered_and_recorded(store, serve_local,
                                                                       tiny_engine):
    from kvtrace.serve.api import MAX_BODY_DEPTH

    assert MAX_BODY_DEPTH < MAX_DEPTH
    server = serve_local(store, run="limit")
    # the body (1) holds metadata (2), whose list nests MAX_BODY_DEPTH - 2 more levels
    text = (f'{{"model": "{tiny_engine.name}", "max_tokens": 2, "messages": [{{"role": "user", '
            f'"content": "x"}}], "metadata": {nested(MAX_BODY_DEPTH - 1)}}}')
    with httpx.Client() as http:
        assert post_raw(http, server.url, text.encode()).status_code == 200
        too_deep = text.replace('"metadata": [', '"metadata": [[', 1).replace("]}", "]]}")
        assert_error(post_raw(http, server.url, too_deep.encode()), 400, "invalid_value")
    [step] = store.path("limit")
    assert isinstance(step.meta["params"]["metadata"], list)


def test_an_integer_wider_than_the_store_keeps_is_a_400(store, serve_local, tiny_engine):
    server = serve_local(store, run="wide")
    data = json.dumps(chat_body(tiny_engine.name, metadata={"n": 10**400})).encode()
    with httpx.Client() as http:
        error = assert_error(post_raw(http, server.url, data), 400, "invalid_value")
        assert "bits" in error["message"]
    assert store.runs() == []


@pytest.mark.parametrize("where", ["content", "tool", "metadata"])
def test_a_lone_surrogate_is_a_400_that_names_where_and_not_the_tokenizer(
    store, serve_local, tiny_engine, where
):
    server = serve_local(store, run="surrogate")
    body = chat_body(tiny_engine.name)
    if where == "content":
        body["messages"] = [{"role": "user", "content": "bad \ud800 text"}]
    elif where == "tool":
        body["tools"] = [{"type": "function", "function": {"name": "f\udc00"}}]
    else:
        body["metadata"] = {"note": "\udfff"}
    data = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \ud800
    with httpx.Client() as http:
        error = assert_error(post_raw(http, server.url, data), 400, "invalid_value")
        assert "surrogate" in error["message"]
        assert "TextEncodeInput" not in error["message"] and "Union" not in error["message"]
        assert_connection_still_answers(http, server.url, tiny_engine.name)
    assert len(store.path("surrogate")) == 1


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          None])
def test_a_chat_body_that_is_not_sent_as_json_is_a_415_and_records_nothing(
    store, serve_local, tiny_engine, content_type
):
    server = serve_local(store, run="typed")
    data = json.dumps(chat_body(tiny_engine.name)).encode()
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{server.url}/chat/completions", content=data, headers=headers)
    error = assert_error(response, 415, "unsupported_media_type")
    assert "application/json" in error["message"]
    assert store.runs() == []
    with_charset = post_raw(httpx.Client(), server.url, data, "application/json; charset=utf-8")
    assert with_charset.status_code == 200


def test_upstream_mode_refuses_the_same_bodies_before_forwarding(store, canned_upstream,
                                                                 serve_upstream):
    proxy = serve_upstream(store, canned_upstream.url, run="guarded")
    bodies = [
        (b'{"model": "canned-model", "messages": [{"role": "user", "content": "x"}], '
         b'"temperature": NaN}', "application/json", 400),
        (b"[" * 100_000, "application/json", 400),
        (json.dumps({"model": "canned-model", "messages": [
            {"role": "user", "content": "\ud800"}]}).encode(), "application/json", 400),
        (json.dumps({"model": "canned-model", "messages": QUESTION}).encode(), "text/plain",
         415),
    ]
    with httpx.Client() as http:
        for data, content_type, status in bodies:
            assert_error(post_raw(http, proxy.url, data, content_type), status)
        answered = http.post(f"{proxy.url}/chat/completions",
                             json={"model": "canned-model", "messages": QUESTION})
        assert answered.status_code == 200
    assert len(canned_upstream.seen) == 1  # only the good request went on
    assert len(store.path("guarded")) == 1


def test_a_prompt_far_past_the_context_is_refused_without_tokenising_it(store, serve_local,
                                                                        tiny_engine):
    """A 15 MB prompt was tokenised on the event loop (12.9 s): now refused at once, and
    /health answers meanwhile, in well under what tokenising the prompt would take (timed
    on a tenth of it here, so that a busy machine slows both sides alike)."""
    server = serve_local(store, run="huge")
    started = time.perf_counter()
    tiny_engine.encode(f"{uuid.uuid4().hex} " + "hello world " * 125_000)
    tokenising_s = 10 * (time.perf_counter() - started)
    body = chat_body(tiny_engine.name)
    body["messages"] = [{"role": "user", "content": "hello world " * 1_250_000}]  # 15 MB
    data = json.dumps(body).encode()
    health = server.url.removesuffix("/v1") + "/health"
    results: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: results.append(
        post_raw(httpx.Client(), server.url, data)))
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        started = time.perf_counter()
        assert httpx.get(health, timeout=60).status_code == 200
        slowest = max(slowest, time.perf_counter() - started)
        time.sleep(0.05)
    sender.join()
    error = assert_error(results[0], 400, "context_length_exceeded")
    assert "8192" in error["message"]
    assert slowest < tokenising_s / 4, (
        f"/health took {slowest:.1f} s while the prompt was checked; tokenising it takes "
        f"~{tokenising_s:.1f} s")
    assert store.runs() == []


def test_a_long_prompt_is_tokenised_off_the_event_loop(store, serve_local, tiny_engine):
    """A prompt under the early bound is tokenised on a worker thread: /health answers while
    it is, within a fraction of the time the tokenisation takes."""
    server = serve_local(store, run="long")
    # ~1 MB, ~160k tokens, new to the engine: chat_tokens keeps the pieces it encoded
    # (segments.py), so the text timed here and the one sent are each met for the first time.
    timed, sent = (f"{uuid.uuid4().hex} " + "hello world " * 80_000 for _ in range(2))
    messages = [{"role": "user", "content": sent}]
    started = time.perf_counter()
    tiny_engine.chat_tokens([{"role": "user", "content": timed}])
    tokenising_s = time.perf_counter() - started
    body = {**chat_body(tiny_engine.name), "messages": messages}
    results: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: results.append(
        post_raw(httpx.Client(), server.url, json.dumps(body).encode())))
    health = server.url.removesuffix("/v1") + "/health"
    sender.start()
    latencies = []
    while sender.is_alive():
        started = time.perf_counter()
        httpx.get(health, timeout=60)
        latencies.append(time.perf_counter() - started)
        time.sleep(0.02)
    sender.join()
    assert_error(results[0], 400, "context_length_exceeded")
    assert len(latencies) >= 3, "the request was refused before /health was asked"
    assert max(latencies) < tokenising_s / 2, (max(latencies), tokenising_s)
    assert store.runs() == []


def test_a_failure_that_is_no_bad_input_is_a_json_500_and_the_connection_stays_usable(
    store, serve_local, tiny_engine
):
    import sqlalchemy as sa

    server = serve_local(store, run="broken")
    with store.engine.begin() as conn:  # the database loses a table under the server
        conn.execute(sa.text("DROP TABLE reflog"))
    with httpx.Client() as http:
        response = http.post(f"{server.url}/chat/completions", json=chat_body(tiny_engine.name),
                             timeout=60)
        error = assert_error(response, 500, "internal_error")
        assert "StoreError" in error["message"]
        assert http.get(f"{server.url}/models").status_code == 200  # the same connection


@pytest.mark.parametrize("mode", ["local", "upstream"])
def test_a_stream_whose_step_cannot_be_written_ends_with_the_500_and_the_connection_stays_usable(
    store, serve_local, serve_upstream, canned_upstream, tiny_engine, mode
):
    import sqlalchemy as sa

    server = (serve_local(store, run="broken") if mode == "local"
              else serve_upstream(store, canned_upstream.url, run="broken"))
    with store.engine.begin() as conn:  # the database loses a table under the server
        conn.execute(sa.text("DROP TABLE reflog"))
    with httpx.Client() as http:
        response = http.post(f"{server.url}/chat/completions", timeout=60,
                             json={**chat_body(tiny_engine.name), "stream": True})
        # the step is written before the last event: that event holds the error instead
        assert response.status_code == 200
        *_, last = [line for line in response.text.splitlines() if line]
        error = json.loads(last.removeprefix("data: "))["error"]
        assert error["code"] == "internal_error" and "StoreError" in error["message"]
        assert "[DONE]" not in response.text
        assert http.get(f"{server.url}/models").status_code == 200
