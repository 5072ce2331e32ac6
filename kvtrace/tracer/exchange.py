"""One HTTP exchange, and how it becomes a step.

Both the httpx transports and `kvtrace serve` capture an `Exchange` (the
request and response as bytes, secrets still in) and hand it to
`record_exchange`, the one place that decides what is stored:

- a successful OpenAI chat completion (POST .../chat/completions with a JSON
  body holding `messages`, answered 2xx with a completion or an SSE stream of
  chunks) becomes a **model_call** step in the function-calling format:
  `messages`, `tools`, the response message (with its `tool_calls`), `params`
  (every other request field but `model`, `stream` and `stream_options`,
  credential fields such as `api_key` or `metadata.password` redacted),
  `usage` as the provider sent it plus `cached_tokens` lifted out of
  `prompt_tokens_details` (absent when not reported: unknown, never 0) and
  `finish_reason`, `timings` (`total_s`, `first_byte_s`), and in `extra` the
  HTTP facts (`url`, `status`, `stream`, `complete`) and the response's own
  `id`, `created`, `system_fingerprint`;
- anything else becomes an **http** step: method, URL, status and headers
  (secrets redacted, see redact.py) in the payload, the bodies as raw blobs
  (`request_body`, `response_body`, content-decoded; credential fields of a
  JSON or form body redacted, other bytes as they were).

A stream the client closed before its end is recorded with what had arrived
and `complete: false` (model_call) or `meta.complete = false` (http).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from kvtrace.errors import UsageError
from kvtrace.store.kinds import HttpExchange, StepKind
from kvtrace.store.usage import Usage
from kvtrace.tracer import sse
from kvtrace.tracer.redact import Redactor

if TYPE_CHECKING:
    from kvtrace.store import Step
    from kvtrace.tracer.recorder import Recorder

NOT_PARAMS = frozenset({"messages", "tools", "model", "stream", "stream_options"})
_RESPONSE_FIELDS = ("id", "created", "system_fingerprint", "service_tier")


@dataclass(frozen=True, slots=True)
class Exchange:
    """A request and its response, as bytes (bodies content-decoded), secrets not yet removed."""

    method: str
    url: str
    request_headers: tuple[tuple[str, str], ...]
    request_body: bytes
    status: int
    response_headers: tuple[tuple[str, str], ...]
    response_body: bytes
    is_complete: bool = True  # False: the client closed a stream before its end
    total_s: float | None = None
    first_byte_s: float | None = None

    @property
    def is_stream(self) -> bool:
        return (_content_type(self.response_headers) or "").startswith("text/event-stream")


def decoded_body(headers: httpx.Headers, raw: bytes) -> bytes:
    """A body without its content-encoding (gzip, br, ...), as httpx decodes it."""
    if not headers.get("content-encoding"):
        return raw
    try:
        return httpx.Response(200, headers={"content-encoding": headers["content-encoding"]},
                              content=raw).content
    except httpx.DecodingError:
        return raw


def is_chat_completions(method: str, url: str) -> bool:
    """Whether a request goes to an OpenAI-style chat-completions endpoint."""
    return method.upper() == "POST" and urlsplit(url).path.rstrip("/").endswith(
        "/chat/completions"
    )


def chat_request(body: bytes) -> dict[str, Any] | None:
    """The JSON body of a chat-completions request, or None when it is not one."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        return None
    return data


def chat_completion(exchange: Exchange) -> dict[str, Any] | None:
    """The completion an exchange answered (assembled from SSE), or None when it is not one."""
    if not 200 <= exchange.status < 300:
        return None
    try:
        if exchange.is_stream:
            completion = sse.assemble(exchange.response_body)
        else:
            completion = json.loads(exchange.response_body)
    except (ValueError, UnicodeDecodeError, TypeError, AttributeError):
        return None
    if not isinstance(completion, dict) or not isinstance(completion.get("choices"), list):
        return None
    if not completion["choices"] or not isinstance(completion["choices"][0], dict):
        return None
    return completion


def request_params(request: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling and tool-choice fields of a chat request (all but messages, tools, ...)."""
    return {key: value for key, value in request.items() if key not in NOT_PARAMS}


def usage_of(completion: Mapping[str, Any]) -> dict[str, Any]:
    """The completion's usage with `cached_tokens` lifted out (only when reported)."""
    usage = dict(completion.get("usage") or {})
    cached = Usage.parse(usage).cached_tokens
    if cached is not None and "cached_tokens" not in usage:
        usage["cached_tokens"] = cached
    finish = completion["choices"][0].get("finish_reason")
    if finish is not None:
        usage["finish_reason"] = finish
    return usage


def record_exchange(recorder: Recorder, exchange: Exchange, redactor: Redactor) -> Step:
    """Record `exchange` as a model_call or an http step (see the module docstring)."""
    if is_chat_completions(exchange.method, exchange.url):
        request = chat_request(exchange.request_body)
        completion = chat_completion(exchange)
        if request is not None and completion is not None:
            try:
                return _record_model_call(recorder, exchange, request, completion, redactor)
            except UsageError:
                pass  # not in the chat shape after all: keep it as an http exchange
    return _record_http(recorder, exchange, redactor)


def _record_model_call(
    recorder: Recorder,
    exchange: Exchange,
    request: dict[str, Any],
    completion: dict[str, Any],
    redactor: Redactor,
) -> Step:
    answered_by = completion.get("model") or request.get("model") or "unknown"
    extra: dict[str, Any] = {
        "http": {
            "url": redactor.url(exchange.url),
            "status": exchange.status,
            "stream": exchange.is_stream,
            "complete": exchange.is_complete,
        },
        "response": {k: completion[k] for k in _RESPONSE_FIELDS if completion.get(k) is not None},
    }
    if request.get("model") not in (None, answered_by):
        extra["request_model"] = request["model"]
    if isinstance(request.get("stream_options"), dict):
        extra["stream_options"] = request["stream_options"]
    timings = {
        key: round(value, 6)
        for key, value in (("total_s", exchange.total_s), ("first_byte_s", exchange.first_byte_s))
        if value is not None
    }
    return recorder.record_model_call(
        request["messages"],
        completion,
        model=str(answered_by),
        tools=request.get("tools"),
        params=redactor.fields(request_params(request)),
        usage=usage_of(completion),
        timings=timings,
        extra=extra,
    )


def _record_http(recorder: Recorder, exchange: Exchange, redactor: Redactor) -> Step:
    payload = {
        "method": exchange.method.upper(),
        "url": redactor.url(exchange.url),
        "status": exchange.status,
        "request_headers": redactor.headers(exchange.request_headers),
        "response_headers": redactor.headers(exchange.response_headers),
    }
    return recorder.record(
        StepKind.HTTP,
        payload,
        meta=HttpExchange.meta(total_s=exchange.total_s, is_complete=exchange.is_complete),
        raw={
            "request_body": redactor.body(exchange.request_body,
                                          _content_type(exchange.request_headers)),
            "response_body": redactor.body(exchange.response_body,
                                           _content_type(exchange.response_headers)),
        },
    )


def _content_type(headers: tuple[tuple[str, str], ...]) -> str | None:
    return next((v for k, v in headers if k.lower() == "content-type"), None)
