"""What `kvtrace serve` promises in each of its three provider APIs alike: one contract suite,
parametrised over the dialect (chat completions, Anthropic Messages, OpenAI Responses), each
spoken through its official SDK over loopback. What only one API has (its tool blocks, its
own errors, Codex's WebSocket) stays in that API's own test file."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvtrace.apis import ProviderApi
from kvtrace.store.kinds import ModelCall
from tests.serve.conftest import SERVER_KEY, recorded_steps

ASKED = "an-agent-s-model"  # a name an unchanged agent sends; the local model answers it
QUESTION = "Write a long story about a lighthouse."


@dataclass(frozen=True)
class Dialect:
    """One API as a client speaks it: its path, a request, its SDK's plain and streamed
    calls (the text they give), its SDK's timeout error, and its error body's shape."""

    name: str
    api: ProviderApi
    path: str
    request: Callable[[int], dict[str, Any]]  # max tokens -> a request body
    plain: Callable[[Any, int], str]  # (sdk, max tokens) -> the answer's text
    streamed: Callable[[Any, int], str]
    sdk: Callable[..., Any]  # (base url, timeout) -> the SDK's client
    timed_out: type[Exception]
    error_message: Callable[[dict[str, Any]], str]


def _chat_stream(sdk: Any, tokens: int) -> str:
    chunks = sdk.chat.completions.create(model=ASKED, max_tokens=tokens, stream=True,
                                         messages=[{"role": "user", "content": QUESTION}])
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _messages_stream(sdk: Any, tokens: int) -> str:
    with sdk.messages.stream(model=ASKED, max_tokens=tokens,
                             messages=[{"role": "user", "content": QUESTION}]) as stream:
        return str(stream.get_final_text())


def _responses_stream(sdk: Any, tokens: int) -> str:
    events = sdk.responses.create(model=ASKED, input=QUESTION, max_output_tokens=tokens,
                                  stream=True)
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


DIALECTS = [
    Dialect(
        "chat", ProviderApi.OPENAI_CHAT, "/chat/completions",
        lambda n: {"model": ASKED, "max_tokens": n,
                   "messages": [{"role": "user", "content": QUESTION}]},
        lambda sdk, n: sdk.chat.completions.create(
            model=ASKED, max_tokens=n,
            messages=[{"role": "user", "content": QUESTION}]).choices[0].message.content,
        _chat_stream,
        lambda url, timeout=60: openai.OpenAI(base_url=url, api_key=SERVER_KEY,
                                              max_retries=0, timeout=timeout),
        openai.APITimeoutError,
        lambda body: body["error"]["message"]),
    Dialect(
        "messages", ProviderApi.ANTHROPIC_MESSAGES, "/messages",
        lambda n: {"model": ASKED, "max_tokens": n,
                   "messages": [{"role": "user", "content": QUESTION}]},
        lambda sdk, n: "".join(b.text for b in sdk.messages.create(
            model=ASKED, max_tokens=n, messages=[{"role": "user", "content": QUESTION}]
        ).content if b.type == "text"),
        _messages_stream,
        lambda url, timeout=60: anthropic.Anthropic(base_url=url.removesuffix("/v1"),
                                                    api_key=SERVER_KEY, max_retries=0,
                                                    timeout=timeout),
        anthropic.APITimeoutError,
        lambda body: body["error"]["message"] if body.get("type") == "error" else ""),
    Dialect(
        "responses", ProviderApi.OPENAI_RESPONSES, "/responses",
        lambda n: {"model": ASKED, "max_output_tokens": n, "input": QUESTION},
        lambda sdk, n: sdk.responses.create(model=ASKED, input=QUESTION,
                                            max_output_tokens=n).output_text,
        _responses_stream,
        lambda url, timeout=60: openai.OpenAI(base_url=url, api_key=SERVER_KEY,
                                              max_retries=0, timeout=timeout),
        openai.APITimeoutError,
        lambda body: body["error"]["message"]),
]
BY_NAME = pytest.mark.parametrize("dialect", DIALECTS, ids=[d.name for d in DIALECTS])


def _steps_when_recorded(store: Any, run: str, count: int) -> list[Any]:
    deadline = time.monotonic() + 20
    while len(steps := recorded_steps(store, run)) < count:
        assert time.monotonic() < deadline, f"{run} has {len(steps)} of {count} steps"
        time.sleep(0.05)
    return steps


@BY_NAME
def test_a_plain_and_a_streamed_answer_agree_and_each_is_one_step_of_its_api(
    dialect, store, serve_local
):
    server = serve_local(store, run=dialect.name)
    sdk = dialect.sdk(server.url)
    plain, streamed = dialect.plain(sdk, 6), dialect.streamed(sdk, 6)
    assert plain and streamed == plain
    steps = _steps_when_recorded(store, dialect.name, 2)
    assert [ModelCall(s).api for s in steps] == [dialect.api, dialect.api]
    assert [ModelCall(s).http["stream"] for s in steps] == [False, True]
    for step in steps:  # one list of parameters per API: streaming is never one
        assert not {"stream", "stream_options"} & set(ModelCall(step).params)


@BY_NAME
def test_a_conversation_of_the_wrong_type_is_a_400_in_the_api_s_shape_and_records_nothing(
    dialect, store, serve_local
):
    server = serve_local(store, run=dialect.name)
    body = dialect.request(4)
    field = "input" if dialect.api is ProviderApi.OPENAI_RESPONSES else "messages"
    body[field] = 42
    reply = httpx.post(server.url + dialect.path, json=body,
                       headers={"Authorization": f"Bearer {SERVER_KEY}"})
    assert reply.status_code == 400
    assert field in dialect.error_message(reply.json())
    assert store.runs() == []


@BY_NAME
def test_an_sdk_that_gives_up_on_a_stream_leaves_no_step_and_no_work(
    dialect, store, serve_local
):
    server = serve_local(store, run="gave-up")
    with pytest.raises(dialect.timed_out):
        dialect.streamed(dialect.sdk(server.url, timeout=1.5), 2000)
    health = server.url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + 20
    while httpx.get(health).json()["queue"]["running"]:
        assert time.monotonic() < deadline, "the engine did not let the work go"
        time.sleep(0.05)
    assert httpx.get(health).json()["queue"]["cancelled"] == 1
    assert store.runs() == []


@BY_NAME
def test_a_stream_dropped_after_its_first_event_is_recorded_once(dialect, store, serve_local):
    server = serve_local(store, run="dropped")
    body = {**dialect.request(40), "stream": True}
    with httpx.stream("POST", server.url + dialect.path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {SERVER_KEY}"}) as reply:
        assert reply.status_code == 200
        assert next(reply.iter_lines())  # the first event arrived; the client leaves
    [step] = _steps_when_recorded(store, "dropped", 1)
    assert ModelCall(step).http["stream"] is True and ModelCall(step).api is dialect.api
