"""Server-sent events: parsing any stream, and OpenAI chat completions' assembled and written.

`events` and `json_events` read the events of any SSE stream; `Assembled`
is what a stream of a provider API adds up to (sse_anthropic.py and
sse_responses.py fill it for their APIs, which name each event by a `type`
in its JSON).

A streamed chat completion is a sequence of `data: {chunk}` events ending
with `data: [DONE]`; each chunk carries a `delta` of the message (role,
content pieces, tool-call pieces keyed by `index`) and, at the end, a
`finish_reason` and (with `stream_options.include_usage`) the usage.
`assemble` turns the bytes of a stream into the one non-streamed completion
they add up to (what the store records); `stream_bytes` is its inverse up
to chunking (what a replaying transport and the local server send).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

DONE = b"[DONE]"


def events(data: bytes) -> Iterator[bytes]:
    """The `data:` payloads of an SSE byte stream, one per event, in order."""
    text = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    for block in text.split(b"\n\n"):
        lines = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines:
            yield b"\n".join(lines)


def json_events(data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON object of each event of a stream; ValueError when one is not a JSON object.

    A last event cut before its end (no blank line after it, data that does
    not parse) is dropped: it never arrived whole.
    """
    payloads = list(events(data))
    is_terminated = data.replace(b"\r\n", b"\n").endswith(b"\n\n")
    for number, payload in enumerate(payloads, 1):
        try:
            event = json.loads(payload)
        except ValueError:
            if number == len(payloads) and not is_terminated:
                return
            raise
        if not isinstance(event, dict):
            raise ValueError("an SSE event's data is not a JSON object")
        yield event


def encode_event(event: Mapping[str, Any]) -> bytes:
    """One `event: TYPE` / `data: JSON` block, as Anthropic and the Responses API send them."""
    return (f"event: {event['type']}\ndata: ".encode()
            + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


@dataclass(frozen=True, slots=True)
class Assembled:
    """What the events of a provider's stream add up to (Anthropic, Responses)."""

    response: dict[str, Any]  # the one non-streamed response the events make
    is_finished: bool  # the API's terminal event arrived (False: the stream was cut)
    error: dict[str, Any] | None = None  # an `error` event's body: the stream failed
    unknown_events: tuple[str, ...] = ()  # event types skipped, as the providers ask


def is_finished(data: bytes) -> bool:
    """Whether the stream so far ends with its `data: [DONE]` event."""
    return data.rstrip().endswith(b"data: " + DONE) or data.rstrip().endswith(b"data:" + DONE)


def assemble(data: bytes) -> dict[str, Any]:
    """The chat completion a chat-completions SSE stream adds up to.

    Raises ValueError when an event is not JSON or not a chunk.
    """
    completion: dict[str, Any] = {"object": "chat.completion"}
    message: dict[str, Any] = {"role": "assistant", "content": None}
    calls: dict[int, dict[str, Any]] = {}
    finish_reason = None
    for payload in events(data):
        if payload.strip() == DONE:
            break
        chunk = json.loads(payload)
        if not isinstance(chunk, dict):
            raise ValueError("an SSE event is not a JSON object")
        for key in ("id", "created", "model", "system_fingerprint", "service_tier"):
            if chunk.get(key) is not None:
                completion[key] = chunk[key]
        if isinstance(chunk.get("usage"), dict):
            completion["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            finish_reason = choice.get("finish_reason") or finish_reason
            delta = choice.get("delta") or {}
            if delta.get("role"):
                message["role"] = delta["role"]
            for key in ("content", "reasoning_content", "refusal"):
                if isinstance(delta.get(key), str):
                    message[key] = (message.get(key) or "") + delta[key]
            for piece in delta.get("tool_calls") or []:
                call = calls.setdefault(int(piece.get("index", len(calls))), {
                    "id": None, "type": "function", "function": {"name": "", "arguments": ""},
                })
                if piece.get("id"):
                    call["id"] = piece["id"]
                function = piece.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    completion["choices"] = [{"index": 0, "message": message, "finish_reason": finish_reason}]
    return completion


def includes_usage(request: Mapping[str, Any]) -> bool:
    """Whether a streamed chat request asks for the usage chunk (`stream_options`)."""
    options = request.get("stream_options")
    return isinstance(options, Mapping) and bool(options.get("include_usage"))


def stream_bytes(completion: Mapping[str, Any], *, include_usage: bool = False) -> bytes:
    """SSE bytes of a completion: a role chunk, content, tool calls, the finish, [DONE]."""
    return b"".join(stream_events(completion, include_usage=include_usage))


def stream_events(completion: Mapping[str, Any], *, include_usage: bool = False) -> Iterator[bytes]:
    """The events of `stream_bytes`, one `data: ...\\n\\n` each."""
    head = {
        key: completion[key]
        for key in ("id", "created", "model", "system_fingerprint", "service_tier")
        if completion.get(key) is not None
    }
    head["object"] = "chat.completion.chunk"
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}

    def event(delta: dict[str, Any], finish: Any = None, **extra: Any) -> bytes:
        chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                 **extra}
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

    yield event({"role": message.get("role", "assistant"), "content": ""})
    for key in ("reasoning_content", "content"):
        if message.get(key):
            yield event({key: message[key]})
    for index, call in enumerate(message.get("tool_calls") or []):
        yield event({"tool_calls": [{"index": index, **call}]})
    yield event({}, choice.get("finish_reason"))
    if include_usage and completion.get("usage") is not None:
        yield b"data: " + json.dumps(
            {**head, "choices": [], "usage": completion["usage"]}
        ).encode() + b"\n\n"
    yield b"data: " + DONE + b"\n\n"
