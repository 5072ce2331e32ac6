"""Secrets in request and response bodies never reach the store (issue 23, item 12).

The README promises that secrets never reach the store; headers and URLs were
redacted, but an `api_key` or `metadata.password` in a chat request's body, a
form-encoded `client_secret` and a JSON `access_token` answer were stored as
sent. The prompt itself (messages, tools) is stored exactly as sent, and a
redacted recording still answers offline.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvtrace.tracer import RecordingTransport, ReplayTransport
from kvtrace.tracer.redact import REDACTED, Redactor, is_secret_field
from tests.canned import SECRET_KEY, all_blob_bytes, all_step_meta

PASSWORD = "hunter2-PASSWORD-9876"
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def _assert_nowhere(store, *secrets: str) -> None:
    for secret in secrets:
        assert not any(secret.encode() in blob for blob in all_blob_bytes(store)), secret
        assert not any(secret in meta for meta in all_step_meta(store)), secret


def _client(url: str, transport: httpx.BaseTransport) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=SECRET_KEY, max_retries=0,
                         http_client=httpx.Client(transport=transport))


def _ask(client: openai.OpenAI) -> str:
    answer = client.chat.completions.create(
        model="canned-model", messages=QUESTION, temperature=0,
        metadata={"password": PASSWORD, "purpose": "demo"},
        extra_body={"api_key": SECRET_KEY, "credentials": {"token": PASSWORD, "user": "ann"}},
    )
    return answer.id


def test_secret_fields_of_a_chat_request_are_redacted_and_the_prompt_is_kept(
    sqlite_store, canned_upstream
):
    answer_id = _ask(_client(canned_upstream.url, RecordingTransport(sqlite_store.run("agent"))))
    assert json.loads(canned_upstream.seen[-1]["body"])["api_key"] == SECRET_KEY  # sent as is
    (step,) = sqlite_store.path("agent")
    params = step.meta["params"]
    assert params["metadata"] == {"password": REDACTED, "purpose": "demo"}
    assert params["api_key"] == REDACTED
    assert params["credentials"] == {"token": REDACTED, "user": "ann"}
    assert params["temperature"] == 0
    assert step.content["messages"] == QUESTION
    _assert_nowhere(sqlite_store, SECRET_KEY, PASSWORD)

    # The same request, secrets and all, is answered from the redacted recording.
    offline = _client(canned_upstream.url, ReplayTransport(sqlite_store.run("agent")))
    served = len(canned_upstream.seen)
    assert _ask(offline) == answer_id and len(canned_upstream.seen) == served  # no 404


def _oauth_upstream(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"access_token": PASSWORD, "token_type": "bearer",
                                     "expires_in": 3600})


def test_form_and_json_bodies_of_an_http_step_are_redacted_and_still_replay(sqlite_store):
    form = {"grant_type": "client_credentials", "client_id": "app", "client_secret": SECRET_KEY}
    recording = RecordingTransport(sqlite_store.run("oauth"),
                                   inner=httpx.MockTransport(_oauth_upstream))
    with httpx.Client(transport=recording) as client:
        response = client.post("https://auth.example/token", data=form)
        assert response.json()["access_token"] == PASSWORD  # the agent got the real answer
        client.post("https://api.example/v1/login", json={"user": "ann", "password": PASSWORD})
    token_step, login_step = sqlite_store.path("oauth")
    assert b"client_secret=[redacted]" in token_step.content["request_body"]
    assert b"client_id=app" in token_step.content["request_body"]
    assert json.loads(token_step.content["response_body"])["access_token"] == REDACTED
    assert json.loads(login_step.content["request_body"]) == {"user": "ann", "password": REDACTED}
    _assert_nowhere(sqlite_store, SECRET_KEY, PASSWORD)

    with httpx.Client(transport=ReplayTransport(sqlite_store.run("oauth"))) as offline:
        replayed = offline.post("https://auth.example/token", data=form)
    assert replayed.status_code == 200 and replayed.json()["token_type"] == "bearer"


@pytest.mark.parametrize("name", ["api_key", "API-Key", "apikey", "password", "db_password",
                                  "client_secret", "secret", "access_token", "refresh_token",
                                  "token", "credentials", "private_key", "Authorization"])
def test_credential_names_are_secret(name):
    assert is_secret_field(name)


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens", "prompt_cache_key",
                                  "eos_token", "token_ids", "key", "keys", "user", "session_id",
                                  "secrets_manager_region", "tokenizer"])
def test_ordinary_parameter_names_are_not(name):
    assert not is_secret_field(name)


def test_a_schema_under_a_secret_name_is_searched_not_replaced():
    schema = {"properties": {"password": {"type": "string"}}, "api_key": 42,
              "nested": [{"secret": "s"}], "flag": True}
    assert Redactor().fields(schema) == {
        "properties": {"password": {"type": "string"}}, "api_key": REDACTED,
        "nested": [{"secret": REDACTED}], "flag": True,
    }


def test_a_body_without_secrets_keeps_its_exact_bytes():
    body = b'{ "input" : "hello",\n "password_hint": "x" }'
    assert Redactor().body(body, "application/json") == body
    assert Redactor().body(b"not json {", "application/json") == b"not json {"
