"""The Anthropic Messages and OpenAI Responses APIs as HTTP endpoints, for recording and replay.

What capture.py (recording), matching.py and served.py (replay) all need to know of
a `POST …/v1/messages` (Anthropic) or `POST …/responses` (OpenAI) exchange:

- `endpoint_for(method, url)`: which API a request speaks, by its path;
- `Endpoint.request(body)`: its JSON body, when it is a request of that API
  (an object holding the conversation field, `messages` or `input`);
- `Endpoint.params(request)`: every request field but the conversation, the
  system prompt (`system`, `instructions`), `tools`, `model` and the
  streaming ones (`stream`, `stream_options`);
- `Endpoint.answer(body, is_stream)`: the response a 2xx answer gives, a
  stream assembled (anthropic.py, responses.py);
- `response_fields`: how the response splits between the step's native
  `response` (content blocks and stop reason; output items and status),
  `meta.usage`, `extra.response` (what is the call's own: id, type or
  object, model, created time, error, previous_response_id; for Anthropic,
  anything else too) and, for Responses, `response_settings`: everything
  else the response repeats of the settings it ran with (`instructions`,
  `tools` with the provider's defaults filled in, `temperature`,
  `reasoning`, ...), a payload blob that every call of a conversation with
  unchanged settings shares, where `extra.response` would keep a long
  `instructions` again in every step. A response is rebuilt from the step
  alone, whatever request asks for it;
- `previous_items`: the conversation a Responses `previous_response_id`
  continues, found among a run's steps by response id;
- `rebuilt_response`, `served_stream`, `not_found_body`: what a replay sends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvtrace.apis import ProviderApi, anthropic, edit_normalizers, request_params, responses
from kvtrace.apis.responses import normalize_input
from kvtrace.apis.sse import Assembled
from kvtrace.errors import UsageError
from kvtrace.store import Step
from kvtrace.store.kinds import TOKEN_IDS_KEY, ModelCall, StepKind


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One provider API's HTTP endpoint (see the module docstring)."""

    api: ProviderApi
    suffix: str  # how the URL path ends
    conversation: str  # the request field holding the conversation
    system: str  # the request field holding the system prompt
    native: tuple[str, ...]  # response fields kept as the step's response, or as usage
    own: tuple[str, ...] | None  # fields that are the call's own (None: all but the native)
    assemble: Callable[[bytes], Assembled]
    stream_bytes: Callable[[Mapping[str, Any]], bytes]

    def request(self, body: bytes) -> dict[str, Any] | None:
        """The JSON body of a request of this API, or None when it is not one."""
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(data, dict):
            return None
        conversation = data.get(self.conversation)
        is_input = self.api is ProviderApi.OPENAI_RESPONSES and isinstance(conversation, str)
        return data if isinstance(conversation, list) or is_input else None

    def params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The request's other fields: sampling, tool choice, thinking, metadata..."""
        return request_params(self.api, request)

    def answer(self, body: bytes, *, is_stream: bool) -> Assembled:
        """The response of a 2xx answer; ValueError when it is not one of this API."""
        if is_stream:
            return self.assemble(body)
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError("the response body is not a JSON object")
        return Assembled(data, True)


ANTHROPIC = Endpoint(
    ProviderApi.ANTHROPIC_MESSAGES, "/v1/messages", "messages", "system",
    ("role", "content", "stop_reason", "stop_sequence", "usage"), None,
    anthropic.assemble, anthropic.stream_bytes)
RESPONSES = Endpoint(
    ProviderApi.OPENAI_RESPONSES, "/responses", "input", "instructions",
    ("output", "status", "incomplete_details", "usage"),
    ("id", "object", "created_at", "completed_at", "model", "error", "previous_response_id"),
    responses.assemble, responses.stream_bytes)
ENDPOINTS = {endpoint.api: endpoint for endpoint in (ANTHROPIC, RESPONSES)}


def endpoint_for(method: str, url: str) -> Endpoint | None:
    """The API a request is sent to, by its method and path (None: neither of these two)."""
    if method.upper() != "POST":
        return None
    path = urlsplit(url).path.rstrip("/")
    return next((e for e in (ANTHROPIC, RESPONSES) if path.endswith(e.suffix)), None)


def response_fields(endpoint: Endpoint, response: Mapping[str, Any]
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(extra.response, response_settings): the response's fields beside its native ones."""
    own: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    for key, value in response.items():
        if key in endpoint.native:
            continue
        if endpoint.own is None or key in endpoint.own:
            own[key] = value
        else:
            settings[key] = value
    return own, settings


def previous_items(steps: Iterable[Step], response_id: str) -> list[dict[str, Any]] | None:
    """The conversation a Responses call continues: the input and output of the step
    among `steps` whose response has id `response_id` (None when none has)."""
    for step in steps:
        if step.kind != StepKind.MODEL_CALL:
            continue
        call = ModelCall(step)
        if call.api is not ProviderApi.OPENAI_RESPONSES:
            continue
        response = call.extra.get("response")
        if isinstance(response, Mapping) and response.get("id") == response_id:
            native = call.native
            output = (native.get("response") or {}).get("output") or []
            return [*native.get("input", []), *output]
    return None


def unanswered_calls(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Stand-ins for the calls a Responses input's tool outputs answer, for a request that
    continues a response the run does not hold (only checked against, never stored)."""
    items = request.get("input")
    return [{"type": "function_call", "call_id": item["call_id"]}
            for item in (items if isinstance(items, list) else [])
            if isinstance(item, Mapping) and str(item.get("type")).endswith("_call_output")
            and isinstance(item.get("call_id"), str)]


def normalized_request(endpoint: Endpoint, request: Mapping[str, Any],
                       prior: list[dict[str, Any]], *,
                       unstored: Iterable[Mapping[str, Any]] = ()
                       ) -> tuple[list[Any], Any, Any]:
    """(conversation, system, tools) of a request as a step stores them; UsageError if malformed.

    `prior`: the items a Responses `previous_response_id` continues (put in
    front); `unstored`: calls made before that are not stored (`unanswered_calls`).
    """
    normalize = edit_normalizers(endpoint.api)
    conversation = request.get(endpoint.conversation)
    if endpoint.api is ProviderApi.OPENAI_RESPONSES:
        items = [*prior, *normalize_input(conversation, [*prior, *unstored])]
    else:
        items = normalize[endpoint.conversation](conversation)
    system = request.get(endpoint.system)
    return (items, normalize[endpoint.system](system) if system is not None else None,
            normalize["tools"](request.get("tools")))


def rebuilt_response(step: Step) -> dict[str, Any]:
    """A recorded call as the JSON response that answered it."""
    call = ModelCall(step)
    native = dict(call.native.get("response") or {})
    usage = call.raw_usage
    usage.pop("finish_reason", None)  # kvtrace's, in chat's vocabulary
    usage.pop(TOKEN_IDS_KEY, None)  # kvtrace's own record of the tokens it generated
    extra = call.extra.get("response")
    extra = dict(extra) if isinstance(extra, Mapping) else {}
    if call.api is ProviderApi.ANTHROPIC_MESSAGES:
        return {"id": f"msg_{step.short_id}", "type": "message", "role": "assistant",
                "model": call.model, **extra, "content": native.get("content", []),
                "stop_reason": native.get("stop_reason"),
                "stop_sequence": native.get("stop_sequence"), "usage": usage or None}
    return {"id": f"resp_{step.short_id}", "object": "response",
            "created_at": int(step.recorded_at), "model": call.model, **extra,
            **call.response_settings, "status": native.get("status", "completed"),
            "output": native.get("output", []),
            "incomplete_details": native.get("incomplete_details"), "usage": usage or None}


def served_stream(step: Step) -> bytes:
    """What a streaming request is sent: the recorded stream, event for event, when the step
    kept one that still adds up to its response (an edited copy does not); else the
    response written as a stream."""
    call = ModelCall(step)
    endpoint = ENDPOINTS[call.api]
    recorded = call.recorded_stream
    if recorded is not None and _adds_up(endpoint, recorded, call.native.get("response")):
        return recorded
    return endpoint.stream_bytes(rebuilt_response(step))


def not_found_body(endpoint: Endpoint | None, message: str) -> dict[str, Any]:
    """An unrecorded request's error body, in the shape of the API it was sent to."""
    if endpoint is ANTHROPIC:
        return {"type": "error", "error": {"type": "not_found_error", "message": message}}
    return {"error": {"message": message, "type": "unrecorded_request", "param": None,
                      "code": "unrecorded_request"}}


def _adds_up(endpoint: Endpoint, stream: bytes, response: Any) -> bool:
    try:
        assembled = endpoint.assemble(stream)
        return bool(edit_normalizers(endpoint.api)["response"](assembled.response) == response)
    except (ValueError, UsageError):  # a kept stream that no longer reads: served as rebuilt
        return False
