"""One transport class for both client libraries: httpx and httpx2 (what openai 3.x and
anthropic 2.x are built on), with the SDKs' own checks of what they are given."""

from __future__ import annotations

import anthropic
import httpx
import httpx2
import openai
import pytest

from kvtrace.store.kinds import ModelCall
from kvtrace.tracer import RecordingTransport, ReplayTransport
from tests.canned import SECRET_KEY

QUESTION = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("library", [httpx, httpx2], ids=["httpx", "httpx2"])
def test_the_openai_sdk_records_through_either_librarys_client(
    sqlite_store, responses_upstream, library
):
    transport = RecordingTransport(sqlite_store.run("agent"))
    client = openai.OpenAI(base_url=f"{responses_upstream.url}/v1", api_key=SECRET_KEY,
                           max_retries=0, http_client=library.Client(transport=transport))
    response = client.responses.create(model="gpt-canned", input=QUESTION)
    call = ModelCall(sqlite_store.show("agent"))
    assert call.api == "openai-responses"
    assert call.extra["response"]["id"] == response.id


def test_the_anthropic_sdk_takes_an_httpx2_client_and_refuses_an_httpx_one(
    sqlite_store, anthropic_upstream
):
    transport = RecordingTransport(sqlite_store.run("agent"))
    with pytest.raises(TypeError, match="httpx2"):
        anthropic.Anthropic(api_key=SECRET_KEY, http_client=httpx.Client(transport=transport))
    # The SDK's own client checks that its transport is not an httpx class: ours is neither's.
    client = anthropic.Anthropic(base_url=anthropic_upstream.url, api_key=SECRET_KEY,
                                 max_retries=0,
                                 http_client=anthropic.DefaultHttpxClient(transport=transport))
    message = client.messages.create(model="claude-canned", max_tokens=64, messages=QUESTION)
    call = ModelCall(sqlite_store.show("agent"))
    assert call.api == "anthropic-messages"
    assert call.native["response"]["content"] == [b.model_dump(exclude_none=True)
                                                  for b in message.content]


def test_one_transport_serves_clients_of_both_libraries_in_turn(
    sqlite_store, anthropic_upstream
):
    transport = RecordingTransport(sqlite_store.run("agent"))
    body = {"model": "claude-canned", "max_tokens": 64, "messages": QUESTION}
    url = f"{anthropic_upstream.url}/v1/messages"
    answers = [httpx.Client(transport=transport).post(url, json=body),
               httpx2.Client(transport=transport).post(url, json=body)]
    assert [type(a) for a in answers] == [httpx.Response, httpx2.Response]
    assert [a.json()["id"] for a in answers] == ["msg_01Canned0001", "msg_01Canned0002"]
    assert len(sqlite_store.path("agent")) == 2
    transport.close()
    replay = ReplayTransport(sqlite_store.run("agent"))
    served = [httpx2.Client(transport=replay).post(url, json=body),
              httpx.Client(transport=replay).post(url, json=body)]
    assert [type(a) for a in served] == [httpx2.Response, httpx.Response]
    assert [a.json()["id"] for a in served] == ["msg_01Canned0001", "msg_01Canned0002"]
