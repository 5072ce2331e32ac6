"""Deterministic replay of recorded exchanges: `ReplayTransport` and its async twin.

    client = openai.OpenAI(http_client=httpx.Client(transport=ReplayTransport(run)))

The recording is the run's steps from its root to its head, like a VCR
cassette. A chat-completions request matches a recorded model_call with the
same URL path, messages, tools, model and params (secret fields redacted on both
sides; `stream` aside: a recording
made without streaming answers a streaming request, as SSE, and the other
way round); any other request matches a recorded http step with the same
method, URL and body (secrets redacted on both sides). Recorded exchanges are
served in order: the first not yet served among the matches, then the last
match again once all were served. Modes (`ReplayMode`):

- `none`: only the recording answers; an unrecorded request gets a 404
  response whose JSON error body (OpenAI's shape) names the closest recorded
  request and how it differs, with `x-should-retry: false`: an SDK shows it
  as it is (`openai.NotFoundError`) and does not retry (a 404 is never
  retried; a 409 would be). `on_unrecorded="raise"` raises
  UnrecordedRequestError instead, for direct httpx users who want an
  exception (an SDK would wrap it in a connection error and retry);
- `new_episodes`: unrecorded requests go to `inner` and are recorded;
- `all`: every request goes to `inner` and is recorded (re-recording).

A model call is served as a chat completion rebuilt from the step: the
recorded response message, finish reason, usage (with
`prompt_tokens_details.cached_tokens` when it was known), id and created
time. An http step is served with its recorded status, headers (less the
redacted ones, content-encoding and length: the stored body is decoded) and body.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from kvtrace.errors import UnrecordedRequestError, UsageError
from kvtrace.rendering import content_text
from kvtrace.store import Run, Step
from kvtrace.store.kinds import HttpExchange, ModelCall, StepKind, view
from kvtrace.store.messages import normalize_messages, normalize_tools
from kvtrace.tracer import sse
from kvtrace.tracer.exchange import chat_request, is_chat_completions, request_params
from kvtrace.tracer.recorder import Recorder, as_recorder
from kvtrace.tracer.redact import REDACTED, Redactor
from kvtrace.tracer.transport import AsyncRecordingTransport, RecordingTransport

_Choice = TypeVar("_Choice", bound=StrEnum)
_DROPPED_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})
_SNIPPET = 60


class ReplayMode(StrEnum):
    NONE = "none"
    NEW_EPISODES = "new_episodes"
    ALL = "all"


class OnUnrecorded(StrEnum):
    """What mode `none` does with a request the recording does not hold."""

    RESPOND = "respond"  # a 404 with a JSON error body, not to be retried
    RAISE = "raise"  # UnrecordedRequestError from the transport


UNRECORDED_STATUS = 404  # not retried by the OpenAI and Anthropic SDKs (408, 409, 429, 5xx are)


@dataclass(frozen=True, slots=True)
class _Key:
    """What a request is matched on."""

    kind: str  # StepKind.MODEL_CALL or StepKind.HTTP
    method: str
    url: str  # redacted; for model calls the path only
    model: str | None = None
    messages: tuple[str, ...] = ()  # canonical JSON of each normalised message
    tools: str | None = None
    params: str | None = None
    body: bytes = b""


class Cassette:
    """The recorded exchanges of a run, matched against new requests."""

    def __init__(self, steps: Iterable[Step], redactor: Redactor) -> None:
        self._redactor = redactor
        self._entries: list[tuple[_Key, Step]] = []
        for step in steps:
            key = _step_key(step, redactor)
            if key is not None:
                self._entries.append((key, step))
        self._served: set[int] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, request: httpx.Request) -> Step | None:
        """The recorded step that answers `request`, or None."""
        key = request_key(request, self._redactor)
        matches = [i for i, (k, _) in enumerate(self._entries) if k == key]
        if not matches:
            return None
        index = next((i for i in matches if i not in self._served), matches[-1])
        self._served.add(index)
        return self._entries[index][1]

    def explain_miss(self, request: httpx.Request) -> str:
        """Why nothing matches: the closest recorded request and how it differs."""
        key = request_key(request, self._redactor)
        what = f"{key.method} {key.url}"
        if not self._entries:
            return f"the recording holds no requests, so {what} cannot be served"
        _, closest, step = max(
            ((_similarity(key, k), i, s) for i, (k, s) in enumerate(self._entries)),
            key=lambda item: (item[0], -item[1]),
        )
        entry_key = self._entries[closest][0]
        return (
            f"{what} was not recorded; the closest recorded request is step "
            f"{step.short_id} (#{step.depth}), which differs: {_difference(key, entry_key)}"
        )


def request_key(request: httpx.Request, redactor: Redactor) -> _Key:
    """The match key of a live request."""
    if is_chat_completions(request.method, str(request.url)):
        body = chat_request(request.content)
        if body is not None:
            try:
                messages = normalize_messages(body["messages"])
                tools = normalize_tools(body.get("tools"))
            except UsageError:
                messages, tools = [], None
            return _Key(
                StepKind.MODEL_CALL, "POST", urlsplit(str(request.url)).path.rstrip("/"),
                model=body.get("model"),
                messages=tuple(_canonical(m) for m in messages),
                tools=_canonical(tools) if tools else None,
                params=_canonical(redactor.fields(request_params(body))),
            )
    return _Key(StepKind.HTTP, request.method.upper(), redactor.url(str(request.url)),
                body=redactor.body(request.content, request.headers.get("content-type")))


def _step_key(step: Step, redactor: Redactor) -> _Key | None:
    typed = view(step)
    if isinstance(typed, ModelCall):
        http = typed.http
        if http is None:
            return None  # recorded by hand or imported: no request to match
        params = typed.params
        if typed.is_seed_chosen:
            params.pop("seed", None)  # the server chose it; the request did not send it
        return _Key(
            StepKind.MODEL_CALL, "POST", urlsplit(str(http.get("url", ""))).path.rstrip("/"),
            model=typed.request_model,
            messages=tuple(_canonical(m) for m in typed.messages),
            tools=_canonical(typed.tools) if typed.tools else None,
            params=_canonical(redactor.fields(params)),  # recordings made before redaction
        )
    if isinstance(typed, HttpExchange):
        body = redactor.body(typed.request_body, typed.request_headers.get("content-type"))
        return _Key(StepKind.HTTP, typed.method, redactor.url(typed.url), body=body)
    return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _similarity(a: _Key, b: _Key) -> tuple[int, ...]:
    shared = 0
    for x, y in zip(a.messages, b.messages, strict=False):
        if x != y:
            break
        shared += 1
    return (a.kind == b.kind, a.url == b.url, a.method == b.method, shared,
            a.model == b.model, a.tools == b.tools, a.params == b.params, a.body == b.body)


def _difference(request: _Key, recorded: _Key) -> str:
    """The first way the request differs from the recorded one, in words."""
    if request.kind != recorded.kind or request.method != recorded.method:
        return f"it is {recorded.method} {recorded.url}"
    if request.url != recorded.url:
        return f"URL {recorded.url} (request: {request.url})"
    if request.kind == StepKind.HTTP:
        return f"the request body ({len(recorded.body)} bytes recorded, {len(request.body)} sent)"
    if request.model != recorded.model:
        return f"model {recorded.model!r} (request: {request.model!r})"
    for index, (mine, theirs) in enumerate(zip(request.messages, recorded.messages,
                                               strict=False)):
        if mine != theirs:
            return (f"messages[{index}]: recorded {_describe(theirs)}, "
                    f"request {_describe(mine)}")
    if len(request.messages) != len(recorded.messages):
        return (f"the recording has {len(recorded.messages)} messages, "
                f"the request {len(request.messages)}")
    if request.tools != recorded.tools:
        return "the tools list"
    mine_params, theirs_params = json.loads(request.params or "{}"), json.loads(
        recorded.params or "{}")
    changed = sorted(k for k in set(mine_params) | set(theirs_params)
                     if mine_params.get(k) != theirs_params.get(k))
    return "params " + ", ".join(
        f"{k}={theirs_params.get(k)!r} (request: {mine_params.get(k)!r})" for k in changed
    )


def _describe(message_json: str) -> str:
    message = json.loads(message_json)
    text = content_text(message.get("content"))
    if message.get("tool_calls"):
        names = [c.get("function", {}).get("name") for c in message["tool_calls"]]
        text = f"{text} tool_calls={names}".strip()
    if len(text) > _SNIPPET:
        text = text[:_SNIPPET] + "..."
    return f"{message.get('role')}: {text!r}"


def unrecorded_response(message: str) -> httpx.Response:
    """The answer to a request the recording does not hold: an error the client shows as is."""
    error = {"message": message, "type": "unrecorded_request", "param": None,
             "code": "unrecorded_request"}
    return httpx.Response(UNRECORDED_STATUS, headers={"x-should-retry": "false"},
                          json={"error": error})


def served_response(step: Step, request: httpx.Request) -> httpx.Response:
    """The response a recorded step gives to `request`."""
    if step.kind == StepKind.HTTP:
        exchange = HttpExchange(step)
        headers = [
            (k, v) for k, v in exchange.response_headers.items()
            if k not in _DROPPED_HEADERS and v != REDACTED
        ]
        return httpx.Response(exchange.status, headers=headers, content=exchange.response_body)
    completion = recorded_completion(step)
    body = chat_request(request.content) or {}
    if body.get("stream"):
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=sse.stream_bytes(completion, include_usage=include_usage))
    return httpx.Response(200, json=completion)


def recorded_completion(step: Step) -> dict[str, Any]:
    """A model_call step as the chat completion that answered it."""
    call = ModelCall(step)
    usage = call.raw_usage
    finish_reason = usage.pop("finish_reason", None)
    usage.pop("cached_tokens", None)  # lifted from prompt_tokens_details, which stays
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


class ReplayTransport(httpx.BaseTransport):
    """Serves `run`'s recorded exchanges (see the module docstring for the modes)."""

    def __init__(self, run: Run | Recorder, mode: str = ReplayMode.NONE,
                 inner: httpx.BaseTransport | None = None, *,
                 redact_headers: Iterable[str] = (),
                 on_unrecorded: str = OnUnrecorded.RESPOND) -> None:
        self.mode = _mode(mode)
        self.on_unrecorded = _on_unrecorded(on_unrecorded)
        self.recorder = as_recorder(run)
        self._redact_headers = tuple(redact_headers)
        self.cassette = Cassette(_steps(self.recorder), Redactor(redact_headers))
        self._inner = inner
        self._live: RecordingTransport | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        if self.mode != ReplayMode.ALL:
            step = self.cassette.find(request)
            if step is not None:
                return served_response(step, request)
            if self.mode == ReplayMode.NONE:
                return _unrecorded(self.cassette.explain_miss(request), self.on_unrecorded)
        if self._live is None:
            self._live = RecordingTransport(self.recorder, self._inner,
                                            redact_headers=self._redact_headers)
        return self._live.handle_request(request)

    def close(self) -> None:
        if self._live is not None:
            self._live.close()


class AsyncReplayTransport(httpx.AsyncBaseTransport):
    """The async twin of ReplayTransport, for `httpx.AsyncClient`."""

    def __init__(self, run: Run | Recorder, mode: str = ReplayMode.NONE,
                 inner: httpx.AsyncBaseTransport | None = None, *,
                 redact_headers: Iterable[str] = (),
                 on_unrecorded: str = OnUnrecorded.RESPOND) -> None:
        self.mode = _mode(mode)
        self.on_unrecorded = _on_unrecorded(on_unrecorded)
        self.recorder = as_recorder(run)
        self._redact_headers = tuple(redact_headers)
        self.cassette = Cassette(_steps(self.recorder), Redactor(redact_headers))
        self._inner = inner
        self._live: AsyncRecordingTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        if self.mode != ReplayMode.ALL:
            step = self.cassette.find(request)
            if step is not None:
                return served_response(step, request)
            if self.mode == ReplayMode.NONE:
                return _unrecorded(self.cassette.explain_miss(request), self.on_unrecorded)
        if self._live is None:
            self._live = AsyncRecordingTransport(self.recorder, self._inner,
                                                 redact_headers=self._redact_headers)
        return await self._live.handle_async_request(request)

    async def aclose(self) -> None:
        if self._live is not None:
            await self._live.aclose()


def _mode(mode: str) -> ReplayMode:
    return _member(ReplayMode, mode, "replay mode")


def _on_unrecorded(value: str) -> OnUnrecorded:
    return _member(OnUnrecorded, value, "on_unrecorded")


def _member(kind: type[_Choice], value: str, what: str) -> _Choice:
    try:
        return kind(value)
    except ValueError as exc:
        raise UsageError(
            f"{what} {value!r}: use one of {', '.join(m.value for m in kind)}"
        ) from exc


def _unrecorded(message: str, on_unrecorded: OnUnrecorded) -> httpx.Response:
    if on_unrecorded == OnUnrecorded.RAISE:
        raise UnrecordedRequestError(message)
    return unrecorded_response(message)


def _steps(recorder: Recorder) -> list[Step]:
    head = recorder.run.refresh()
    return recorder.store.path(recorder.name) if head is not None else []
