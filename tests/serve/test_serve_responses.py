"""`kvtrace serve` speaks the OpenAI Responses API, driven by the official `openai` SDK.

Local mode: a tiny random model, real stores on SQLite and PostgreSQL, real
loopback sockets. Upstream mode: tests/serve/canned_proxied.py behind the
server. Codex's WebSocket attempt is answered 426, tried with a real
WebSocket client (the `websockets` package).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvtrace.apis import ProviderApi
from kvtrace.store.kinds import ModelCall
from tests.serve.conftest import SERVER_KEY

ASKED = "gpt-4o-mini"  # a name an unchanged agent sends; the local model answers it
SYSTEM = "You are a terse assistant. " * 8
TOOLS = [{"type": "function", "name": "lookup", "description": "Look a word up",
          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}]
AFTER_A_TOOL = [
    {"role": "user", "content": "Say hi."},
    {"type": "function_call", "call_id": "call_1", "name": "lookup",
     "arguments": '{"word": "hi"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "a greeting"},
]


def client(server, key: str = SERVER_KEY, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, **options)


def post(server, body, **headers) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}/responses", content=data, timeout=120,
                      headers={"content-type": "application/json", **headers})


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["message"] and error["type"], error
    return error


# -- local mode --------------------------------------------------------------------------------


def test_plain_streamed_and_tool_requests_are_answered_in_the_responses_shape_and_recorded(
    store, serve_local, tiny_engine
):
    server = serve_local(store, run="codex", api_key=SERVER_KEY)
    sdk = client(server)
    plain = sdk.responses.create(model=ASKED, instructions=SYSTEM, input="Say hi.",
                                 max_output_tokens=6)
    assert plain.object == "response" and plain.model == tiny_engine.name
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    [message] = plain.output
    assert message.type == "message" and message.content[0].text == plain.output_text != ""
    prompt = tiny_engine.chat_tokens([{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "Say hi."}])
    assert plain.usage.input_tokens == len(prompt) and plain.usage.output_tokens == 6
    assert plain.usage.input_tokens_details.cached_tokens == 0
    assert plain.usage.total_tokens == len(prompt) + 6
    events = list(sdk.responses.create(model=ASKED, instructions=SYSTEM, input="Say hi.",
                                       max_output_tokens=6, stream=True))
    assert [event.type for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[4].delta == plain.output_text  # greedy: the same answer
    final = events[-1].response
    assert final.usage.input_tokens_details.cached_tokens == len(prompt) - 1  # all but the last
    tooled = sdk.responses.create(model=ASKED, instructions=SYSTEM, input=AFTER_A_TOOL,
                                  tools=TOOLS, max_output_tokens=6, tool_choice="auto")
    assert tooled.status in ("completed", "incomplete")
    calls = [ModelCall(step) for step in store.path("codex")]
    assert [call.api for call in calls] == [ProviderApi.OPENAI_RESPONSES] * 3
    assert [call.model for call in calls] == [tiny_engine.name] * 3
    assert [call.request_model for call in calls] == [ASKED] * 3
    assert calls[0].native["instructions"] == SYSTEM
    assert calls[0].native["input"] == [{"type": "message", "role": "user",
                                         "content": "Say hi."}]
    assert calls[0].native["response"]["status"] == "incomplete"
    assert calls[0].response == {"role": "assistant", "content": plain.output_text}
    assert calls[0].usage.finish_reason == "length"
    assert calls[1].http["stream"] is True and calls[1].is_complete
    assert calls[1].usage.prompt_tokens == len(prompt)
    assert calls[1].usage.cached_tokens == len(prompt) - 1
    assert calls[2].native["tools"] == TOOLS
    assert calls[2].messages[-1] == {"role": "tool", "tool_call_id": "call_1",
                                     "content": "a greeting"}
    assert calls[2].params == {"max_output_tokens": 6, "tool_choice": "auto"}
    assert len(calls[2].output_ids or []) == tooled.usage.output_tokens


def test_a_run_recorded_by_the_server_replays_offline_through_replay_transport(
    store, serve_local
):
    from kvtrace.tracer import ReplayTransport

    server = serve_local(store, run="served")
    request = {"model": ASKED, "instructions": SYSTEM, "input": AFTER_A_TOOL, "tools": TOOLS,
               "max_output_tokens": 5}
    live = client(server).responses.create(**request)
    live_events = list(client(server).responses.create(**request, stream=True))
    offline = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0,
                            http_client=httpx.Client(
                                transport=ReplayTransport(store.run("served"))))
    again = offline.responses.create(**request)
    # the step alone rebuilds the answer (its usage also carries kvtrace's token ids)
    assert again.model_dump(exclude={"usage"}) == live.model_dump(exclude={"usage"})
    assert again.usage.input_tokens_details == live.usage.input_tokens_details
    assert (again.usage.input_tokens, again.usage.output_tokens) == (
        live.usage.input_tokens, live.usage.output_tokens)
    again_events = list(offline.responses.create(**request, stream=True))
    assert [e.model_dump() for e in again_events] == [e.model_dump() for e in live_events]


BAD_INPUTS = [
    ("malformed JSON", b'{"model": "m", "input": [', "not valid JSON", None),
    ("missing input", {"input": None}, "input", "input"),
    ("input a number", {"input": 5}, "input", "input"),
    ("an item without a type", {"input": [{"content": "x"}]}, "must have a type", "input"),
    ("a function_call without a call_id", {"input": [
        {"type": "function_call", "name": "f", "arguments": "{}"}]}, "needs a call_id", "input"),
    ("an output answering no call", {"input": [
        {"role": "user", "content": "x"},
        {"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
     "answers no function call", "input"),
    ("arguments not a string", {"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
     "arguments must be a JSON string", "input"),
    ("a message of role tool", {"input": [{"role": "tool", "content": "x"}]}, "role", "input"),
    ("temperature a string", {"temperature": "hot"}, "temperature", "temperature"),
    ("temperature past 2", {"temperature": 3}, "temperature", "temperature"),
    ("max_output_tokens zero", {"max_output_tokens": 0}, "max_output_tokens",
     "max_output_tokens"),
    ("tools not a list", {"tools": {"name": "f"}}, "tools must be", "tools"),
    ("a function tool without a name", {"tools": [{"type": "function"}]}, "needs a name",
     "tools"),
    ("tool_choice a number", {"tool_choice": 5}, "tool_choice", "tool_choice"),
    ("instructions a list", {"instructions": ["x"]}, "instructions", "instructions"),
    ("stream a string", {"stream": "yes"}, "stream", "stream"),
    ("previous_response_id in local mode", {"previous_response_id": "resp_1"},
     "whole conversation", "previous_response_id"),
    ("NaN", b'{"model": "m", "input": "x", "temperature": NaN}', "finite", None),
]


@pytest.mark.parametrize(("case", "body", "named", "param"), BAD_INPUTS,
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_400_in_openai_s_error_shape_and_records_nothing(
    sqlite_store, serve_local, case, body, named, param
):
    server = serve_local(sqlite_store, run="bad")
    if isinstance(body, dict):
        body = {k: v for k, v in {"model": ASKED, "input": "Say hi.", "max_output_tokens": 3,
                                  **body}.items() if v is not None}
    error = assert_openai_error(post(server, body), 400)
    assert error["type"] == "invalid_request_error" and named in error["message"]
    assert error["param"] == param
    assert sqlite_store.runs() == []


def test_bad_input_records_nothing_on_either_store(store, serve_local):
    server = serve_local(store, run="bad")
    with pytest.raises(openai.BadRequestError, match="answers no function call"):
        client(server).responses.create(model=ASKED, input=AFTER_A_TOOL[::2])
    assert store.runs() == []


def test_with_strict_model_another_name_is_a_404(sqlite_store, serve_local, tiny_engine):
    server = serve_local(sqlite_store, run="strict", strict_model=True)
    with pytest.raises(openai.NotFoundError) as refused:
        client(server).responses.create(model=ASKED, input="Say hi.", max_output_tokens=2)
    assert refused.value.body["code"] == "model_not_found"
    answered = client(server).responses.create(model=tiny_engine.name, input="Say hi.",
                                               max_output_tokens=2)
    assert answered.model == tiny_engine.name
    assert ModelCall(sqlite_store.show("strict")).request_model == tiny_engine.name


# -- Codex's WebSocket attempt ----------------------------------------------------------------


def refused_upgrade(server) -> object:
    """Open a WebSocket to /v1/responses as Codex does; the HTTP response that refused it."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = server.url.replace("http://", "ws://", 1) + "/responses"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, open_timeout=30, additional_headers={"Authorization": "Bearer x"})
    return refused.value.response


def test_a_websocket_upgrade_on_responses_is_a_426_and_http_answers_after_it(
    sqlite_store, serve_local
):
    server = serve_local(sqlite_store, run="codex")
    response = refused_upgrade(server)
    assert response.status_code == 426
    assert json.loads(response.body)["error"]["code"] == "upgrade_required"
    assert sqlite_store.runs() == []
    answered = client(server).responses.create(model=ASKED, input="Say hi.",
                                               max_output_tokens=2)
    assert answered.object == "response"
    assert len(sqlite_store.path("codex")) == 1


def test_upstream_mode_answers_the_websocket_426_itself(sqlite_store, canned_apis,
                                                        serve_upstream):
    proxy = serve_upstream(sqlite_store, canned_apis.url, run="codex")
    assert refused_upgrade(proxy).status_code == 426
    assert canned_apis.seen == []


# -- upstream mode -----------------------------------------------------------------------------


def test_upstream_responses_calls_become_model_call_steps(store, canned_apis, serve_upstream):
    proxy = serve_upstream(store, canned_apis.url, run="captured")
    sdk = client(proxy)
    sdk.responses.create(model="gpt-canned", input="Weather?")
    list(sdk.responses.create(model="gpt-canned", input="Weather?", stream=True))
    calls = [ModelCall(step) for step in store.path("captured")]
    assert [call.api for call in calls] == [ProviderApi.OPENAI_RESPONSES] * 2
    assert [call.response["content"] for call in calls] == ["It is sunny."] * 2
    assert calls[0].usage.cached_tokens == 40 and calls[0].usage.prompt_tokens == 50


def test_upstream_mode_forwards_a_continuation_whose_calls_the_upstream_keeps(
    sqlite_store, canned_apis, serve_upstream
):
    proxy = serve_upstream(sqlite_store, canned_apis.url, run="continued")
    body = {"model": "gpt-canned", "previous_response_id": "resp_canned_1",
            "input": [{"type": "function_call_output", "call_id": "call_up", "output": "ok"}]}
    assert post(proxy, body).status_code == 200
    assert json.loads(canned_apis.seen[-1]["body"]) == body
