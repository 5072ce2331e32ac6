"""What a recorded step answers: the response a replayed request gets, or the miss's 404.

A chat model call is served as a chat completion rebuilt from the step: the
recorded response message, finish reason, usage (with
`prompt_tokens_details.cached_tokens` when it was known), id and created
time. An Anthropic or Responses call is served as JSON rebuilt from its
native response, `extra.response`, `response_settings` and usage
(endpoints.py); a streaming request gets the recorded stream as it arrived,
event for event and byte for byte, or, for a call recorded without
streaming (or an edited copy whose stream no longer adds up to its
response), the response written as that API's stream. An http step is
served with its recorded status, headers (less the redacted ones,
content-encoding and length: the stored body is decoded) and body.
Responses are of the request's own library, httpx or httpx2 (clients.py).

An unrecorded request gets a 404 whose JSON error body (in the shape of
the API it was sent to: Anthropic's `not_found_error` for `/v1/messages`,
OpenAI's otherwise) says what was missed, with `x-should-retry: false`: an
SDK shows it as it is and does not retry (a 404 is never retried; a 409
would be).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from kvtrace.apis import chat
from kvtrace.store import Step
from kvtrace.store.kinds import TOKEN_IDS_KEY, HttpExchange, ModelCall, StepKind
from kvtrace.tracer.clients import response_class
from kvtrace.tracer.endpoints import (
    ENDPOINTS,
    Endpoint,
    endpoint_for,
    not_found_body,
    rebuilt_response,
    served_stream,
)
from kvtrace.tracer.exchange import chat_request
from kvtrace.tracer.redact import REDACTED

_DROPPED_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})
UNRECORDED_STATUS = 404  # not retried by the OpenAI and Anthropic SDKs (408, 409, 429, 5xx are)


def unrecorded_response(request: httpx.Request, message: str) -> httpx.Response:
    """The answer to a request the recording does not hold: an error the client shows as is."""
    endpoint = endpoint_for(request.method, str(request.url))
    return response_class(request)(UNRECORDED_STATUS, headers={"x-should-retry": "false"},
                                   json=not_found_body(endpoint, message))


def served_response(step: Step, request: httpx.Request) -> httpx.Response:
    """The response a recorded step gives to `request`."""
    respond = response_class(request)
    if step.kind == StepKind.HTTP:
        exchange = HttpExchange(step)
        headers = [
            (k, v) for k, v in exchange.response_headers.items()
            if k not in _DROPPED_HEADERS and v != REDACTED
        ]
        return respond(exchange.status, headers=headers, content=exchange.response_body)
    endpoint: Endpoint | None = ENDPOINTS.get(ModelCall(step).api)
    if endpoint is not None:
        body = endpoint.request(request.content) or {}
        if body.get("stream"):
            return respond(200, headers={"content-type": "text/event-stream"},
                           content=served_stream(step))
        return respond(200, json=rebuilt_response(step))
    completion = recorded_completion(step)
    body = chat_request(request.content) or {}
    if body.get("stream"):
        return respond(200, headers={"content-type": "text/event-stream"},
                       content=chat.stream_bytes(completion,
                                                include_usage=chat.includes_usage(body)))
    return respond(200, json=completion)


def recorded_completion(step: Step) -> dict[str, Any]:
    """A model_call step as the chat completion that answered it."""
    call = ModelCall(step)
    usage = call.raw_usage
    finish_reason = usage.pop("finish_reason", None)
    usage.pop("cached_tokens", None)  # lifted from prompt_tokens_details, which stays
    usage.pop(TOKEN_IDS_KEY, None)  # kvtrace's own record of the tokens it generated
    response = call.extra.get("response")
    response = response if isinstance(response, Mapping) else {}
    completion: dict[str, Any] = {
        "id": response.get("id", f"chatcmpl-{step.short_id}"),
        "object": "chat.completion",
        "created": response.get("created", int(step.recorded_at)),
        "model": call.model,
        **{k: v for k, v in response.items() if k not in ("id", "created")},
        "choices": [{"index": 0, "message": call.response,
                     "finish_reason": finish_reason, "logprobs": None}],
    }
    if usage:
        completion["usage"] = usage
    return completion
