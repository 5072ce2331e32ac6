"""Server-sent events of Anthropic's Messages API: assembled into what they add up to, and written.

A streamed message is `message_start` (the message with no content yet and
the input side of its usage), then for each content block
`content_block_start`, `content_block_delta`s and `content_block_stop`,
then `message_delta` (the stop reason and the usage so far, which replaces
the start's counts key by key) and `message_stop`; `ping` may come anywhere.
A delta is a `text_delta`, an `input_json_delta` (a piece of a tool input's
JSON, parsed once the block stops), a `thinking_delta`, a `signature_delta`
(a thinking block's signature) or a `citations_delta`.

`assemble` turns a stream into the message it adds up to (what the store
records); `stream_bytes` writes a message as such a stream (what a replay
sends for a call recorded without streaming; a streamed call is replayed
from the bytes it arrived as). The outcomes that are not a plain message:

- an event or delta type not listed above is skipped, as Anthropic's
  versioning policy tells clients to do, and named in `unknown_events`;
- an `error` event (`overloaded_error` mid-stream, say) ends the stream with
  `error` set: there is no message to record;
- no `message_stop` (the connection closed early, or the client left):
  `is_finished` is false and the message holds what had arrived; a tool
  block that had not stopped is kept only when the JSON of its input had
  arrived whole;
- an event out of order (a delta before its block's start) or data that is
  not JSON raises ValueError: the stream is not one this module can read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from kvtrace.apis.sse import Assembled, encode_event, json_events

TERMINAL = "message_stop"
# Blocks whose `input` arrives as pieces of JSON.
_JSON_INPUT = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})
_TEXT_DELTAS = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}
_NOT_IN_START = ("content", "stop_reason", "stop_sequence", "usage")


def assemble(data: bytes) -> Assembled:
    """The message an Anthropic SSE stream adds up to (see the module docstring)."""
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    pieces: dict[int, list[str]] = {}  # input JSON of tool blocks, as it arrives
    stopped: set[int] = set()
    unknown: list[str] = []
    for event in json_events(data):
        kind = event.get("type")
        if kind == "ping":
            continue
        if kind == "error":
            error = event.get("error")
            return Assembled(message or {}, False, dict(error) if isinstance(error, Mapping)
                             else {"message": str(error)}, tuple(unknown))
        if kind == "message_start":
            message = dict(_object(event.get("message"), "message_start.message"))
            message.setdefault("content", [])
            continue
        if kind not in ("content_block_start", "content_block_delta", "content_block_stop",
                        "message_delta", TERMINAL):
            unknown.append(str(kind))
            continue
        if message is None:
            raise ValueError(f"a {kind} event before message_start")
        if kind == TERMINAL:
            return Assembled(_finish(message, blocks, pieces, stopped), True, None,
                             tuple(unknown))
        if kind == "message_delta":
            message.update(_object(event.get("delta", {}), "message_delta.delta"))
            usage = _object(event.get("usage") or {}, "message_delta.usage")
            message["usage"] = {**(message.get("usage") or {}), **usage}
            continue
        index = event.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(f"a {kind} event without an integer index")
        if kind == "content_block_start":
            blocks[index] = dict(_object(event.get("content_block"), "content_block"))
            if blocks[index].get("type") in _JSON_INPUT:
                pieces[index] = []
            continue
        if index not in blocks:
            raise ValueError(f"a {kind} event for block {index} before its start")
        if kind == "content_block_stop":
            stopped.add(index)
        elif not _apply_delta(blocks[index], pieces.get(index),
                              _object(event.get("delta"), "content_block_delta.delta")):
            unknown.append(f"{kind}.{event['delta'].get('type')}")
    if message is None:
        raise ValueError("the stream has no message_start")
    return Assembled(_finish(message, blocks, pieces, stopped), False, None, tuple(unknown))


def stream_bytes(message: Mapping[str, Any]) -> bytes:
    """SSE bytes of a message: start, each block in one delta, the message delta, stop."""
    return b"".join(encode_event(event) for event in stream_events(message))


def stream_events(message: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The events of `stream_bytes`, as JSON objects."""
    usage = dict(message.get("usage") or {})
    start = {k: v for k, v in message.items() if k not in _NOT_IN_START}
    yield {"type": "message_start", "message": {
        **start, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {**usage, "output_tokens": min(1, usage.get("output_tokens") or 0)}}}
    for index, block in enumerate(message.get("content") or []):
        yield from _block_events(index, block)
    yield {"type": "message_delta",
           "delta": {"stop_reason": message.get("stop_reason"),
                     "stop_sequence": message.get("stop_sequence")},
           "usage": usage}
    yield {"type": TERMINAL}


def _block_events(index: int, block: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    kind = block.get("type")
    head = dict(block)
    deltas: list[dict[str, Any]] = []
    if kind in _JSON_INPUT:
        head["input"] = {}
        if block.get("input"):
            deltas.append({"type": "input_json_delta",
                           "partial_json": json.dumps(block["input"], ensure_ascii=False)})
    elif kind in ("text", "thinking"):
        head[kind] = ""
        if kind == "text" and block.get("citations"):
            head["citations"] = []
            deltas.extend({"type": "citations_delta", "citation": c} for c in block["citations"])
        if block.get(kind):
            deltas.append({"type": f"{kind}_delta", kind: block[kind]})
        if kind == "thinking":
            head.pop("signature", None)
            if "signature" in block:
                deltas.append({"type": "signature_delta", "signature": block["signature"]})
    yield {"type": "content_block_start", "index": index, "content_block": head}
    for delta in deltas:
        yield {"type": "content_block_delta", "index": index, "delta": delta}
    yield {"type": "content_block_stop", "index": index}


def _apply_delta(block: dict[str, Any], pieces: list[str] | None,
                 delta: Mapping[str, Any]) -> bool:
    """Add one delta to its block; False when its type is unknown (skipped)."""
    kind = delta.get("type")
    if kind in _TEXT_DELTAS:
        field = _TEXT_DELTAS[kind]
        block[field] = str(block.get(field) or "") + _string(delta.get(field), kind)
    elif kind == "input_json_delta" and pieces is not None:
        pieces.append(_string(delta.get("partial_json"), kind))
    elif kind == "citations_delta":
        block["citations"] = [*(block.get("citations") or []), delta.get("citation")]
    else:
        return False
    return True


def _finish(message: dict[str, Any], blocks: dict[int, dict[str, Any]],
            pieces: dict[int, list[str]], stopped: set[int]) -> dict[str, Any]:
    """The message with its blocks in order, tool inputs parsed."""
    content = []
    for index in sorted(blocks):
        block = blocks[index]
        if index in pieces and (pieces[index] or index not in stopped):
            try:
                block["input"] = json.loads("".join(pieces[index]))
            except ValueError:
                if index in stopped:
                    raise ValueError(f"block {index}: the tool input is not JSON") from None
                continue  # cut before its JSON closed: left out (its bytes stay in the stream)
        content.append(block)
    return {**message, "content": content}


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} is not a JSON object")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"a {where} without its string")
    return value
