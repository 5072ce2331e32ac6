"""How a live request finds its recorded step: the match key, the `Cassette`, a miss in words.

A chat-completions, Anthropic Messages or Responses request matches a
recorded model_call of the same API with the same URL path, conversation,
system prompt (`system`, `instructions`), tools, model and params (secret
fields redacted on both sides; `stream` aside: a recording made without
streaming answers a streaming request, and the other way round). A
Responses request naming a `previous_response_id` is matched with the
conversation of the recorded call of that id in front of its input, as it
was recorded. Any other request matches a recorded http step with the same
method, URL and body (secrets redacted on both sides). Recorded exchanges
are served in order: the first not yet served among the matches, then the
last match again once all were served. A recorded answer cut before its end
(the client left mid-stream, `kinds.is_cut`) is never served: it is no
answer. A request that matches nothing is explained by the closest recorded
request and the first way it differs (or by the cut answer it matched).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvtrace.apis import ProviderApi, request_params
from kvtrace.apis.chat import normalize_messages, normalize_tools
from kvtrace.errors import UsageError
from kvtrace.rendering import content_text
from kvtrace.store import Step
from kvtrace.store.kinds import HttpExchange, ModelCall, StepKind, is_cut, view
from kvtrace.tracer.endpoints import (
    ENDPOINTS,
    RESPONSES,
    endpoint_for,
    normalized_request,
    previous_items,
    unanswered_calls,
)
from kvtrace.tracer.exchange import chat_request, is_chat_completions
from kvtrace.tracer.redact import Redactor

_SNIPPET = 60


@dataclass(frozen=True, slots=True)
class MatchKey:
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
        self._entries: list[tuple[MatchKey, Step]] = []
        self._cut: list[tuple[MatchKey, Step]] = []  # answers cut before their end: never served
        for step in self._steps:
            key = _step_key(step, redactor)
            if key is not None:
                (self._cut if is_cut(step) else self._entries).append((key, step))
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
        cut = next((step for k, step in self._cut if k == key), None)
        if cut is not None:
            return (f"{what} was recorded at step {cut.short_id} (#{cut.depth}), but its answer "
                    "was cut before its end (the client left mid-stream), so it is not served")
        if not self._entries:
            return f"the recording holds no requests, so {what} cannot be served"
        _, closest, step = max(
            ((_similarity(key, k), i, s) for i, (k, s) in enumerate(self._entries)),
            key=lambda item: (item[0], -item[1]),
        )
        entry_key = self._entries[closest][0]
        return (
            f"{what} was not recorded; the closest recorded request is step "
            f"{step.short_id} (#{step.depth}), which differs: {difference(key, entry_key)}"
        )

    def step_key(self, step: Step) -> MatchKey | None:
        """The match key of a recorded step (None: it holds no request to match)."""
        return _step_key(step, self._redactor)

    def key(self, request: httpx.Request) -> MatchKey:
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
        return MatchKey(
            str(endpoint.api), "POST", urlsplit(str(request.url)).path.rstrip("/"),
            model=body.get("model"), messages=tuple(_canonical(m) for m in messages),
            system=_canonical(system) if system else None,
            tools=_canonical(tools) if tools else None,
            params=_canonical(self._redactor.fields(endpoint.params(body))),
        )


def request_key(request: httpx.Request, redactor: Redactor) -> MatchKey:
    """The match key of a live chat-completions or plain HTTP request."""
    if is_chat_completions(request.method, str(request.url)):
        body = chat_request(request.content)
        if body is not None:
            try:
                messages = normalize_messages(body["messages"])
                tools = normalize_tools(body.get("tools"))
            except UsageError:
                messages, tools = [], None
            return MatchKey(
                StepKind.MODEL_CALL, "POST", urlsplit(str(request.url)).path.rstrip("/"),
                model=body.get("model"),
                messages=tuple(_canonical(m) for m in messages),
                tools=_canonical(tools) if tools else None,
                params=_canonical(redactor.fields(
                    request_params(ProviderApi.OPENAI_CHAT, body))),
            )
    return MatchKey(StepKind.HTTP, request.method.upper(), redactor.url(str(request.url)),
                body=redactor.body(request.content, request.headers.get("content-type")))


def _step_key(step: Step, redactor: Redactor) -> MatchKey | None:
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
            return MatchKey(
                str(typed.api), "POST", path, model=typed.request_model,
                messages=tuple(_canonical(m) for m in native.get(endpoint.conversation, [])),
                system=_canonical(system) if system else None,
                tools=_canonical(native["tools"]) if native.get("tools") else None,
                params=_canonical(redactor.fields(params)),
            )
        return MatchKey(
            StepKind.MODEL_CALL, "POST", path,
            model=typed.request_model,
            messages=tuple(_canonical(m) for m in typed.messages),
            tools=_canonical(typed.tools) if typed.tools else None,
            params=_canonical(redactor.fields(params)),  # recordings made before redaction
        )
    if isinstance(typed, HttpExchange):
        body = redactor.body(typed.request_body, typed.request_headers.get("content-type"))
        return MatchKey(StepKind.HTTP, typed.method, redactor.url(typed.url), body=body)
    return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _similarity(a: MatchKey, b: MatchKey) -> tuple[int, ...]:
    shared = 0
    for x, y in zip(a.messages, b.messages, strict=False):
        if x != y:
            break
        shared += 1
    return (a.kind == b.kind, a.url == b.url, a.method == b.method, shared,
            a.model == b.model, a.system == b.system, a.tools == b.tools, a.params == b.params,
            a.body == b.body)


def difference(request: MatchKey, recorded: MatchKey) -> str:
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
