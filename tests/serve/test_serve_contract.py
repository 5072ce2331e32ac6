"""What `kvtrace serve` promises in each of its three provider APIs alike: one contract suite,
parametrised over the dialect (chat completions, Anthropic Messages, OpenAI Responses), each
spoken through its official SDK over loopback, in local mode (a tiny random model) and in
upstream mode (a canned upstream on loopback). What only one API has (its tool blocks, its own
errors and usage fields, Codex's WebSocket, a replay's exact objects) stays in that API's own
test file."""

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
from kvtrace.store.kinds import ModelCall, view
from tests.canned import (
    CANNED_COMPLETION,
    CANNED_STREAM,
    SECRET_KEY,
    all_blob_bytes,
    all_step_meta,
)
from tests.serve.canned_proxied import (
    CANNED_MESSAGE,
    CANNED_MESSAGE_STREAM,
    CANNED_RESPONSE,
    CANNED_RESPONSE_STREAM,
)
from tests.serve.conftest import SERVER_KEY, recorded_steps

ASKED = "an-agent-s-model"  # a name an unchanged agent sends; the local model answers it
QUESTION = "Write a long story about a lighthouse."
SYSTEM = "You are a terse assistant. " * 8


@dataclass(frozen=True)
class Dialect:
    """One API as a client speaks it: its path, a request, its SDK's plain and streamed
    calls (the text they give), its SDK's timeout error, and its error body's shape."""

    name: str
    api: ProviderApi
    path: str
    ask: Callable[[str, int], dict[str, Any]]  # (question, max tokens) -> a request body
    plain: Callable[[Any, int], str]  # (sdk, max tokens) -> the answer's text
    streamed: Callable[[Any, int], str]
    sdk: Callable[..., Any]  # (base url, timeout) -> the SDK's client
    timed_out: type[Exception]
    error_message: Callable[[dict[str, Any]], str]
    # (sdk, conversation so far, question) -> (the answer's cached prompt tokens, the
    # conversation with the question and the answer appended, as the client sends it on)
    turn: Callable[[Any, list[Any], str], tuple[int, list[Any]]]
    key_header: str  # where the client's own key travels (sent upstream as it came)
    canned: str  # the canned upstream's fixture, and the bytes it answers with
    canned_plain: bytes
    canned_stream: list[bytes]
    # A tool result that answers no call, and what the refusal says; None where the API
    # has no such rule (chat completions take a tool message as it comes)
    orphan: tuple[dict[str, Any], str] | None = None

    def request(self, tokens: int) -> dict[str, Any]:
        return self.ask(QUESTION, tokens)


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


def _chat_turn(sdk: Any, sent: list[Any], question: str) -> tuple[int, list[Any]]:
    sent = sent or [{"role": "system", "content": SYSTEM}]
    sent = [*sent, {"role": "user", "content": question}]
    answer = sdk.chat.completions.create(model=ASKED, messages=sent, max_tokens=8)
    return (answer.usage.prompt_tokens_details.cached_tokens,
            [*sent, answer.choices[0].message.model_dump(exclude_none=True)])


def _messages_turn(sdk: Any, sent: list[Any], question: str) -> tuple[int, list[Any]]:
    sent = [*sent, {"role": "user", "content": question}]
    answer = sdk.messages.create(model=ASKED, max_tokens=8, system=SYSTEM, messages=sent)
    said = {"role": "assistant",
            "content": [block.model_dump(exclude_none=True) for block in answer.content]}
    return answer.usage.cache_read_input_tokens, [*sent, said]


def _responses_turn(sdk: Any, sent: list[Any], question: str) -> tuple[int, list[Any]]:
    sent = [*sent, {"role": "user", "content": question}]
    answer = sdk.responses.create(model=ASKED, instructions=SYSTEM, input=sent,
                                  max_output_tokens=8)
    return (answer.usage.input_tokens_details.cached_tokens,
            [*sent, *(item.model_dump(exclude_none=True) for item in answer.output)])


DIALECTS = [
    Dialect(
        "chat", ProviderApi.OPENAI_CHAT, "/chat/completions",
        lambda text, n: {"model": ASKED, "max_tokens": n,
                         "messages": [{"role": "user", "content": text}]},
        lambda sdk, n: sdk.chat.completions.create(
            model=ASKED, max_tokens=n,
            messages=[{"role": "user", "content": QUESTION}]).choices[0].message.content,
        _chat_stream,
        lambda url, timeout=60: openai.OpenAI(base_url=url, api_key=SERVER_KEY,
                                              max_retries=0, timeout=timeout),
        openai.APITimeoutError,
        lambda body: body["error"]["message"],
        _chat_turn, "authorization", "canned_upstream", CANNED_COMPLETION, CANNED_STREAM),
    Dialect(
        "messages", ProviderApi.ANTHROPIC_MESSAGES, "/messages",
        lambda text, n: {"model": ASKED, "max_tokens": n,
                         "messages": [{"role": "user", "content": text}]},
        lambda sdk, n: "".join(b.text for b in sdk.messages.create(
            model=ASKED, max_tokens=n, messages=[{"role": "user", "content": QUESTION}]
        ).content if b.type == "text"),
        _messages_stream,
        lambda url, timeout=60: anthropic.Anthropic(base_url=url.removesuffix("/v1"),
                                                    api_key=SERVER_KEY, max_retries=0,
                                                    timeout=timeout),
        anthropic.APITimeoutError,
        lambda body: body["error"]["message"] if body.get("type") == "error" else "",
        _messages_turn, "x-api-key", "canned_apis", CANNED_MESSAGE, CANNED_MESSAGE_STREAM,
        ({"model": ASKED, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x"}]}]}, "answers no tool_use")),
    Dialect(
        "responses", ProviderApi.OPENAI_RESPONSES, "/responses",
        lambda text, n: {"model": ASKED, "max_output_tokens": n, "input": text},
        lambda sdk, n: sdk.responses.create(model=ASKED, input=QUESTION,
                                            max_output_tokens=n).output_text,
        _responses_stream,
        lambda url, timeout=60: openai.OpenAI(base_url=url, api_key=SERVER_KEY,
                                              max_retries=0, timeout=timeout),
        openai.APITimeoutError,
        lambda body: body["error"]["message"],
        _responses_turn, "authorization", "canned_apis", CANNED_RESPONSE, CANNED_RESPONSE_STREAM,
        ({"model": ASKED, "input": [
            {"role": "user", "content": "Say hi."},
            {"type": "function_call_output", "call_id": "call_1", "output": "a greeting"}]},
         "no function call made before it")),
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


@BY_NAME
def test_a_recorded_conversation_replays_at_the_oracle_bound(
    dialect, store, serve_local, tiny_engine, tmp_path
):
    from kvtrace.engine import KVCache
    from kvtrace.replay import LocalBackend, replay

    server = serve_local(store, run="conversation")
    sdk = dialect.sdk(server.url)
    sent: list[Any] = []
    cached = []
    for question in ("One?", "Two?", "Three?"):
        hit, sent = dialect.turn(sdk, sent, question)
        cached.append(hit)
    assert cached[0] == 0 and cached[1] > 60 and cached[2] > cached[1]  # the prefix cache
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine, disk_dir=tmp_path / "fresh-kv"))
    report = replay(store, "conversation", backend, mode="verify")
    assert report.is_match is True
    assert report.total.reused_tokens == report.total.oracle_tokens > 0


# -- upstream mode -----------------------------------------------------------------------------


@BY_NAME
def test_upstream_answers_come_back_byte_for_byte_and_are_recorded_without_the_key(
    dialect, store, serve_upstream, request
):
    canned = request.getfixturevalue(dialect.canned)
    proxy = serve_upstream(store, canned.url, run="proxied")
    body = {**dialect.ask("Weather?", 20), "model": "canned-model"}
    key = f"Bearer {SECRET_KEY}" if dialect.key_header == "authorization" else SECRET_KEY
    plain = httpx.post(proxy.url + dialect.path, json=body, headers={dialect.key_header: key})
    assert plain.status_code == 200 and plain.content == dialect.canned_plain
    assert canned.seen[-1]["headers"][dialect.key_header] == key
    with httpx.stream("POST", proxy.url + dialect.path, json={**body, "stream": True}) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        received = b"".join(reply.iter_raw())
        assert len(store.path("proxied")) == 2  # recorded before its last event was passed on
    assert received == b"".join(dialect.canned_stream)
    steps = store.path("proxied")
    assert [ModelCall(step).api for step in steps] == [dialect.api, dialect.api]
    assert [view(step).is_complete for step in steps] == [True, True]
    assert ModelCall(steps[1]).http == {"url": canned.url + dialect.path, "status": 200,
                                        "stream": True, "complete": True}
    assert not any(SECRET_KEY.encode() in blob for blob in all_blob_bytes(store))
    assert not any(SECRET_KEY in meta for meta in all_step_meta(store))


@BY_NAME
def test_upstream_mode_refuses_a_bad_request_before_forwarding_it(
    dialect, sqlite_store, serve_upstream, request
):
    canned = request.getfixturevalue(dialect.canned)
    proxy = serve_upstream(sqlite_store, canned.url, run="guarded")
    body = dialect.request(4)
    field = "input" if dialect.api is ProviderApi.OPENAI_RESPONSES else "messages"
    body[field] = 42
    refusals = [(body, field), *([dialect.orphan] if dialect.orphan else [])]
    for bad, says in refusals:
        reply = httpx.post(proxy.url + dialect.path, json=bad)
        assert reply.status_code == 400 and says in dialect.error_message(reply.json())
    assert canned.seen == [] and sqlite_store.runs() == []


@BY_NAME
def test_an_upstream_stream_the_client_drops_is_closed_and_recorded_incomplete(
    dialect, store, serve_upstream, request
):
    canned = request.getfixturevalue(dialect.canned)
    proxy = serve_upstream(store, canned.url, run="mid-way")
    body = {**dialect.ask("hang", 5), "stream": True}
    first_line = dialect.canned_stream[0].decode().split("\n")[0]
    with httpx.stream("POST", proxy.url + dialect.path, json=body, timeout=30) as reply:
        assert reply.status_code == 200
        assert next(reply.iter_lines()) == first_line  # it arrived; the client leaves
    deadline = time.monotonic() + 10
    # the run's step, not only its name (PostgreSQL may show the name first)
    while canned.abandoned != ["/v1" + dialect.path] or not (
            steps := recorded_steps(store, "mid-way")):
        assert time.monotonic() < deadline, "the proxy did not close its upstream request"
        time.sleep(0.05)
    [step] = steps
    assert view(step).is_complete is False  # nothing of it is recorded as complete
    canned.release.set()
