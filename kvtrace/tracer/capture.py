"""How a captured exchange becomes a step of the recorder's run: `record_exchange`.

Both the httpx transports and `kvtrace serve` capture an `Exchange`
(exchange.py) and hand it here, the one place that decides what is stored:

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
- a successful Anthropic Messages call (POST .../v1/messages) or OpenAI
  Responses call (POST .../responses), plain or streamed, becomes a
  **model_call** step in that API's own shape (`api`, `system` or
  `instructions`, `messages` or `input`, the native response; endpoints.py
  says how the response's fields are split): `params` (every request field
  but the conversation, system prompt, tools, model, `stream` and
  `stream_options`, credentials redacted), `usage` as the provider sent it
  plus `finish_reason`, `timings`, `extra.http` (with `complete`: the
  stream's terminal event arrived; `unknown_events`: event types skipped),
  `extra.response`, `extra.request_model`, and a Responses object's
  repeated settings as `response_settings`. A streamed call also
  keeps its SSE body as it arrived (the raw field `stream`), so a replay
  sends the same events byte for byte, unknown ones included; rebuilding
  events from the response would lose what kvtrace does not model (the
  chunking, obfuscation fields, event types it skips). The zstd blob codec
  takes the repeats inside a stream: on a 60-call conversation the kept
  streams add 0.43 (Anthropic) and 0.91 (Responses) times the
  conversation's distinct bytes on disk (docs/tracer.md). A Responses call
  that names a `previous_response_id` recorded in the run is stored with
  that call's input and output in front of its own (`extra.previous_items`:
  how many); one not found is stored as sent, and `extra.previous_missing`
  says so;
- anything else becomes an **http** step: method, URL, status and headers
  (secrets redacted, see redact.py) in the payload, the bodies as raw blobs
  (`request_body`, `response_body`, content-decoded; credential fields of a
  JSON or form body redacted, other bytes as they were).

A stream the client closed before its end is recorded with what had arrived
and `complete: false` (model_call) or `meta.complete = false` (http).

A 2xx exchange with the Anthropic or Responses path that is not a call of
that API (a body that is not its JSON, malformed blocks, a `tool_result`
answering no `tool_use`, a stream that does not parse or that ends with an
`error` event) is kept whole as an http step whose `meta.not_model_call`
says why: nothing is recorded half.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvtrace.apis import ProviderApi, finish_reason, request_params, stored_fields
from kvtrace.errors import UsageError
from kvtrace.store.kinds import STREAM_FIELD, HttpExchange, StepKind
from kvtrace.tracer.endpoints import (
    RESPONSES,
    Endpoint,
    endpoint_for,
    normalized_request,
    previous_items,
    response_fields,
    unanswered_calls,
)
from kvtrace.tracer.exchange import (
    Exchange,
    chat_completion,
    chat_request,
    content_type,
    is_chat_completions,
    usage_of,
)
from kvtrace.tracer.redact import Redactor

if TYPE_CHECKING:
    from kvtrace.store import Step
    from kvtrace.tracer.recorder import Recorder

_RESPONSE_FIELDS = ("id", "created", "system_fingerprint", "service_tier")
_RECENT_STEPS = 64  # where a previous_response_id is looked for first, before the whole run


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
    endpoint = endpoint_for(exchange.method, exchange.url)
    if endpoint is None or not 200 <= exchange.status < 300:
        return _record_http(recorder, exchange, redactor)
    try:
        call = _api_call(recorder, exchange, endpoint, redactor)
    except (ValueError, UsageError) as exc:
        return _record_http(recorder, exchange, redactor,
                            not_model_call=f"not an {endpoint.api} call: {exc}")
    return recorder.record_model_call(**call)


def _api_call(recorder: Recorder, exchange: Exchange, endpoint: Endpoint,
              redactor: Redactor) -> dict[str, Any]:
    """The arguments of record_model_call for an Anthropic or Responses exchange, checked.

    Raises ValueError or UsageError when the exchange is not a call of that API.
    """
    request = endpoint.request(exchange.request_body)
    if request is None:
        raise ValueError(f"the request body is not a JSON object with {endpoint.conversation}")
    answer = endpoint.answer(exchange.response_body, is_stream=exchange.is_stream)
    if answer.error is not None:
        raise ValueError("the stream ended with an error event: "
                         + json.dumps(answer.error, ensure_ascii=False)[:300])
    response = answer.response
    http: dict[str, Any] = {
        "url": redactor.url(exchange.url), "status": exchange.status,
        "stream": exchange.is_stream,
        # A stream is whole when its terminal event came (closed by the server or not).
        "complete": answer.is_finished if exchange.is_stream else exchange.is_complete,
    }
    if answer.unknown_events:
        http["unknown_events"] = sorted(set(answer.unknown_events))
    extra: dict[str, Any] = {"http": http}
    prior: list[dict[str, Any]] = []
    unstored: list[dict[str, Any]] = []
    previous = request.get("previous_response_id") if endpoint is RESPONSES else None
    if isinstance(previous, str) and previous:
        found = _previous_items(recorder, previous)
        if found is None:
            extra["previous_missing"] = (f"{previous} is not a response recorded in run "
                                         f"{recorder.name!r}: the input is stored as sent")
            unstored = unanswered_calls(request)
        else:
            prior = found
            extra["previous_items"] = len(prior)
    conversation, system, tools = normalized_request(endpoint, request, prior,
                                                     unstored=unstored)
    stored_fields(endpoint.api, conversation, response, tools=tools, system=system,
                  prior=unstored)  # checked here: a failure keeps the exchange as http
    extra["response"], settings = response_fields(endpoint, response)
    answered_by = response.get("model") or request.get("model") or "unknown"
    if request.get("model") not in (None, answered_by):
        extra["request_model"] = request["model"]
    if isinstance(request.get("stream_options"), dict):
        extra["stream_options"] = request["stream_options"]
    usage = dict(response.get("usage") or {})
    finish = finish_reason(endpoint.api, response)
    if finish is not None:
        usage["finish_reason"] = finish
    return {
        "messages": conversation, "response": response, "model": str(answered_by),
        "tools": tools, "system": system, "api": endpoint.api,
        "params": redactor.fields(endpoint.params(request)), "usage": usage,
        "timings": _timings(exchange), "extra": extra,
        "raw": {STREAM_FIELD: exchange.response_body} if exchange.is_stream else None,
        "prior": unstored or None, "response_settings": settings or None,
    }


def _previous_items(recorder: Recorder, response_id: str) -> list[dict[str, Any]] | None:
    """The items a previous_response_id continues, from the run's recent steps, else all."""
    recent = list(recorder.store.log(recorder.name, limit=_RECENT_STEPS))
    found = previous_items(recent, response_id)
    if found is None and len(recent) == _RECENT_STEPS:
        found = previous_items(recorder.store.log(recorder.name), response_id)
    return found


def _timings(exchange: Exchange) -> dict[str, float]:
    return {
        key: round(value, 6)
        for key, value in (("total_s", exchange.total_s), ("first_byte_s", exchange.first_byte_s))
        if value is not None
    }


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
    timings = _timings(exchange)
    return recorder.record_model_call(
        request["messages"],
        completion,
        model=str(answered_by),
        tools=request.get("tools"),
        params=redactor.fields(request_params(ProviderApi.OPENAI_CHAT, request)),
        usage=usage_of(completion),
        timings=timings,
        extra=extra,
    )


def _record_http(recorder: Recorder, exchange: Exchange, redactor: Redactor, *,
                 not_model_call: str | None = None) -> Step:
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
        meta=HttpExchange.meta(total_s=exchange.total_s, is_complete=exchange.is_complete,
                               not_model_call=not_model_call),
        raw={
            "request_body": redactor.body(exchange.request_body,
                                          content_type(exchange.request_headers)),
            "response_body": redactor.body(exchange.response_body,
                                           content_type(exchange.response_headers)),
        },
    )
