"""Deterministic replay of recorded exchanges: `ReplayTransport` and its async twin.

    client = openai.OpenAI(http_client=httpx.Client(transport=ReplayTransport(run)))
    client = anthropic.Anthropic(http_client=httpx2.Client(transport=ReplayTransport(run)))

The recording is the run's steps from its root to its head, like a VCR
cassette. A chat-completions, Anthropic Messages or Responses request
matches a recorded model_call of the same API with the same URL path,
conversation, system prompt (`system`, `instructions`), tools, model and
params (secret fields redacted on both sides; `stream` aside: a recording
made without streaming answers a streaming request, as SSE, and the other
way round). A Responses request naming a `previous_response_id` is matched
with the conversation of the recorded call of that id in front of its input,
as it was recorded. Any other request matches a recorded http step with the
same method, URL and body (secrets redacted on both sides). Recorded exchanges are
served in order: the first not yet served among the matches, then the last
match again once all were served. Modes (`ReplayMode`):

- `none`: only the recording answers; an unrecorded request gets a 404
  response whose JSON error body (in the shape of the API it was sent to:
  Anthropic's `not_found_error` for `/v1/messages`, OpenAI's otherwise)
  names the closest recorded request and how it differs, with
  `x-should-retry: false`: an SDK shows it as it is (`openai.NotFoundError`,
  `anthropic.NotFoundError`) and does not retry (a 404 is never
  retried; a 409 would be). `on_unrecorded="raise"` raises
  UnrecordedRequestError instead, for direct httpx users who want an
  exception (an SDK would wrap it in a connection error and retry);
- `new_episodes`: unrecorded requests go to `inner` and are recorded;
- `all`: every request goes to `inner` and is recorded (re-recording).

A chat model call is served as a chat completion rebuilt from the step: the
recorded response message, finish reason, usage (with
`prompt_tokens_details.cached_tokens` when it was known), id and created
time. An Anthropic or Responses call is served as JSON rebuilt from its
native response, `extra.response`, `response_settings` and usage
(endpoints.py); a streaming
request gets the recorded stream as it arrived, event for event and byte for
byte, or, for a call recorded without streaming (or an edited copy whose
stream no longer adds up to its response), the response written as that
API's stream. An http step is served with its recorded status, headers
(less the redacted ones, content-encoding and length: the stored body is
decoded) and body. Responses are of the request's own library, httpx or
httpx2 (clients.py).
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
from kvtrace.store.apis import ProviderApi
from kvtrace.store.kinds import TOKEN_IDS_KEY, HttpExchange, ModelCall, StepKind, view
from kvtrace.store.messages import normalize_messages, normalize_tools
from kvtrace.tracer import sse
from kvtrace.tracer.clients import response_class
from kvtrace.tracer.endpoints import (
    ENDPOINTS,
    RESPONSES,
    Endpoint,
    endpoint_for,
    normalized_request,
    not_found_body,
    previous_items,
    rebuilt_response,
    served_stream,
    unanswered_calls,
)
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
    messages: tuple[str, ...] = ()  # canonical JSON of each message (or item) as stored
    system: str | None = None  # Anthropic's system, Responses' instructions
    tools: str | None = None
    params: str | None = None
    body: bytes = b""


class Cassette:
    """The recorded exchanges of a run, matched against new requests."""

    def __init__(self, steps: Iterable[Step], redactor: Redactor) -> None:
        self._redactor = redactor
        self._steps = list(steps)
        self._entries: list[tuple[_Key, Step]] = []
        for step in self._steps:
            key = _step_key(step, redactor)
            if key is not None:
                self._entries.append((key, step))
        self._served: set[int] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, request: httpx.Request) -> Step | None:
        """The recorded step that answers `request`, or None."""
        key = self.key(request)
        matches = [i for i, (k, _) in enumerate(self._entries) if k == key]
        if not matches:
            return None
        index = next((i for i in matches if i not in self._served), matches[-1])
        self._served.add(index)
        return self._entries[index][1]

    def explain_miss(self, request: httpx.Request) -> str:
        """Why nothing matches: the closest recorded request and how it differs."""
        key = self.key(request)
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

    def step_key(self, step: Step) -> _Key | None:
        """The match key of a recorded step (None: it holds no request to match)."""
        return _step_key(step, self._redactor)

    def key(self, request: httpx.Request) -> _Key:
        """The match key of a live request."""
        endpoint = endpoint_for(request.method, str(request.url))
        body = endpoint.request(request.content) if endpoint is not None else None
        if endpoint is None or body is None:
            return request_key(request, self._redactor)
        previous = body.get("previous_response_id") if endpoint is RESPONSES else None
        found = (previous_items(reversed(self._steps), previous)
                 if isinstance(previous, str) and previous else [])
        prior, unstored = (found, []) if found is not None else ([], unanswered_calls(body))
        try:
            messages, system, tools = normalized_request(endpoint, body, prior,
                                                         unstored=unstored)
        except UsageError:
            messages, system, tools = [], None, None
        return _Key(
            str(endpoint.api), "POST", urlsplit(str(request.url)).path.rstrip("/"),
            model=body.get("model"), messages=tuple(_canonical(m) for m in messages),
            system=_canonical(system) if system else None,
            tools=_canonical(tools) if tools else None,
            params=_canonical(self._redactor.fields(endpoint.params(body))),
        )


def request_key(request: httpx.Request, redactor: Redactor) -> _Key:
    """The match key of a live chat-completions or plain HTTP request."""
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
        path = urlsplit(str(http.get("url", ""))).path.rstrip("/")
        endpoint = ENDPOINTS.get(typed.api)
        if endpoint is not None:
            native = typed.native
            system = native.get(endpoint.system)
            return _Key(
                str(typed.api), "POST", path, model=typed.request_model,
                messages=tuple(_canonical(m) for m in native.get(endpoint.conversation, [])),
                system=_canonical(system) if system else None,
                tools=_canonical(native["tools"]) if native.get("tools") else None,
                params=_canonical(redactor.fields(params)),
            )
        return _Key(
            StepKind.MODEL_CALL, "POST", path,
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
            a.model == b.model, a.system == b.system, a.tools == b.tools, a.params == b.params,
            a.body == b.body)


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
    field = "input" if recorded.kind == ProviderApi.OPENAI_RESPONSES else "messages"
    for index, (mine, theirs) in enumerate(zip(request.messages, recorded.messages,
                                               strict=False)):
        if mine != theirs:
            return (f"{field}[{index}]: recorded {_describe(theirs)}, "
                    f"request {_describe(mine)}")
    if len(request.messages) != len(recorded.messages):
        noun = "messages" if field == "messages" else "input items"
        return (f"the recording has {len(recorded.messages)} {noun}, "
                f"the request {len(request.messages)}")
    if request.system != recorded.system:
        return "the system prompt (system, instructions)"
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
    """A message (chat, Anthropic) or an item (Responses) in a few words."""
    message = json.loads(message_json)
    if "role" not in message:  # a Responses item other than a message
        return f"{message.get('type')}: {message.get('name') or message.get('call_id') or ''!r}"
    content = message.get("content")
    blocks = [b for b in content if isinstance(b, Mapping)] if isinstance(content, list) else []
    text = "".join(str(b["text"]) for b in blocks if "text" in b) if blocks else content_text(
        content)
    others = [b.get("name") or b.get("tool_use_id") or b.get("type") for b in blocks
              if "text" not in b]
    if message.get("tool_calls"):
        others = [c.get("function", {}).get("name") for c in message["tool_calls"]]
        text = f"{text} tool_calls={others}".strip()
    elif others:
        text = f"{text} {others}".strip()
    if len(text) > _SNIPPET:
        text = text[:_SNIPPET] + "..."
    return f"{message.get('role')}: {text!r}"


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
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return respond(200, headers={"content-type": "text/event-stream"},
                       content=sse.stream_bytes(completion, include_usage=include_usage))
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


class ReplayTransport:
    """Serves `run`'s recorded exchanges (see the module docstring for the modes)."""

    def __init__(self, run: Run | Recorder, mode: str = ReplayMode.NONE,
                 inner: Any = None, *,
                 redact_headers: Iterable[str] = (),
                 on_unrecorded: str = OnUnrecorded.RESPOND,
                 until: int | None = None, fork: str | None = None,
                 edit: Mapping[str, Any] | None = None) -> None:
        self.mode = _mode(mode)
        self.on_unrecorded = _on_unrecorded(on_unrecorded)
        self.recorder = as_recorder(run)
        self._redact_headers = tuple(redact_headers)
        self.cassette = Cassette(_steps(self.recorder), Redactor(redact_headers))
        self.prefix = _prefix(self.recorder, self.mode, until, fork, edit, self._redact_headers)
        self._inner = inner
        self._live: RecordingTransport | None = None

    def __enter__(self) -> ReplayTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        if self.prefix is not None:
            step = self.prefix.serve(request)
            if step is not None:
                return served_response(step, request)
            if self._live is None:
                self._live = RecordingTransport(self.prefix.go_live(), self._inner,
                                                redact_headers=self._redact_headers)
            return self._live.handle_request(request)
        if self.mode != ReplayMode.ALL:
            step = self.cassette.find(request)
            if step is not None:
                return served_response(step, request)
            if self.mode == ReplayMode.NONE:
                return _unrecorded(request, self.cassette.explain_miss(request),
                                   self.on_unrecorded)
        if self._live is None:
            self._live = RecordingTransport(self.recorder, self._inner,
                                            redact_headers=self._redact_headers)
        return self._live.handle_request(request)

    def close(self) -> None:
        if self._live is not None:
            self._live.close()


class AsyncReplayTransport:
    """The async twin of ReplayTransport, for `httpx.AsyncClient` and `httpx2.AsyncClient`."""

    def __init__(self, run: Run | Recorder, mode: str = ReplayMode.NONE,
                 inner: Any = None, *,
                 redact_headers: Iterable[str] = (),
                 on_unrecorded: str = OnUnrecorded.RESPOND,
                 until: int | None = None, fork: str | None = None,
                 edit: Mapping[str, Any] | None = None) -> None:
        self.mode = _mode(mode)
        self.on_unrecorded = _on_unrecorded(on_unrecorded)
        self.recorder = as_recorder(run)
        self._redact_headers = tuple(redact_headers)
        self.cassette = Cassette(_steps(self.recorder), Redactor(redact_headers))
        self.prefix = _prefix(self.recorder, self.mode, until, fork, edit, self._redact_headers)
        self._inner = inner
        self._live: AsyncRecordingTransport | None = None

    async def __aenter__(self) -> AsyncReplayTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        if self.prefix is not None:
            step = self.prefix.serve(request)
            if step is not None:
                return served_response(step, request)
            if self._live is None:
                import anyio.to_thread

                live_run = await anyio.to_thread.run_sync(self.prefix.go_live)
                self._live = AsyncRecordingTransport(live_run, self._inner,
                                                     redact_headers=self._redact_headers)
            return await self._live.handle_async_request(request)
        if self.mode != ReplayMode.ALL:
            step = self.cassette.find(request)
            if step is not None:
                return served_response(step, request)
            if self.mode == ReplayMode.NONE:
                return _unrecorded(request, self.cassette.explain_miss(request),
                                   self.on_unrecorded)
        if self._live is None:
            self._live = AsyncRecordingTransport(self.recorder, self._inner,
                                                 redact_headers=self._redact_headers)
        return await self._live.handle_async_request(request)

    async def aclose(self) -> None:
        if self._live is not None:
            await self._live.aclose()


def _prefix(recorder: Recorder, mode: ReplayMode, until: int | None, fork: str | None,
            edit: Mapping[str, Any] | None, redact_headers: tuple[str, ...]) -> Any:
    """The RecordedPrefix of `until` (None without it): prefix.py, `--from` from Python."""
    if until is None:
        if fork is not None or edit is not None:
            raise UsageError("fork and edit go with until=K (answer steps 1..K from the "
                             "recording, then go live on a fork)", param="until")
        return None
    if mode is not ReplayMode.NEW_EPISODES:
        raise UsageError("until=K answers the first K steps from the recording and the rest "
                         "live: it goes with mode='new_episodes'", param="until")
    from kvtrace.tracer.prefix import RecordedPrefix

    return RecordedPrefix.of_run(recorder.store, recorder.name, until, fork=fork, edit=edit,
                                 redact_headers=redact_headers)


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


def _unrecorded(request: httpx.Request, message: str,
                on_unrecorded: OnUnrecorded) -> httpx.Response:
    if on_unrecorded == OnUnrecorded.RAISE:
        raise UnrecordedRequestError(message)
    return unrecorded_response(request, message)


def _steps(recorder: Recorder) -> list[Step]:
    head = recorder.run.refresh()
    return recorder.store.path(recorder.name) if head is not None else []
