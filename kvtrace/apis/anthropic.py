"""Anthropic Messages calls: their own shape checked, and the chat conversation they mean.

A model call spoken in the Messages API (Claude Code, the Claude Agent SDK,
the `anthropic` package) is stored as it was sent (docs/store.md, "Three
APIs"): the `messages` list item by item, `system` (a string or text
blocks, `cache_control` kept) and `tools` as payload fields, and the
response's `role`, `content` blocks, `stop_reason` and `stop_sequence`.
What analyze, replay, diff, report and export read is the same call in
OpenAI chat shape, derived here by one pure function (`to_chat`,
`chat_response`, `chat_tools`) so that it is never stored twice:

- `system` becomes a first system message (its text blocks as text parts);
- a `text` block is a text part; a message of one text block has it as its
  content string;
- `tool_use` becomes an assistant `tool_calls` entry (arguments the JSON of
  `input`); `tool_result` becomes a `tool` message with `tool_call_id`,
  its content a string or text parts, and `is_error: true` kept;
- `thinking` becomes the assistant message's `reasoning_content` (the
  signature lives only in the stored blocks); `redacted_thinking` has no
  text and no counterpart;
- `server_tool_use` and the results of server tools (`*_tool_result`), run
  by the provider, stay content parts of their own type, as do images and
  documents: the engine renders text only.

Checking is strict where a wrong shape would break a replay: a block needs
its fields, and a `tool_result` must answer a `tool_use` of an earlier
assistant turn (the API itself refuses the opposite with a 400). Block
types this module does not know are kept as they are.

Streaming. A streamed message is `message_start` (the message with no content yet and
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

from kvtrace.apis.plain import to_plain
from kvtrace.apis.sse import Assembled, encode_event, json_events
from kvtrace.errors import UsageError

ROLES = frozenset({"user", "assistant"})
# Request fields that are not parameters: the conversation, system, tools, model, streaming.
NOT_PARAMS = frozenset({"messages", "system", "tools", "model", "stream", "stream_options"})
# Stop reasons in OpenAI's finish_reason vocabulary (the one Usage reads).
FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                  "tool_use": "tool_calls", "pause_turn": "stop", "refusal": "content_filter"}
_RESPONSE_KEYS = ("role", "content", "stop_reason", "stop_sequence")
# Required string fields of the block types whose shape a replay depends on.
_FIELDS = {
    "text": ("text",), "thinking": ("thinking",), "redacted_thinking": ("data",),
    "tool_use": ("id", "name"), "server_tool_use": ("id", "name"),
    "tool_result": ("tool_use_id",),
}


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's `messages` in stored form: checked, SDK objects made plain, nulls dropped."""
    plain = to_plain(messages)
    if not isinstance(plain, list):
        raise UsageError("messages must be a list of Anthropic messages (role and content)")
    out = [_message(m, f"messages[{i}]") for i, m in enumerate(plain)]
    _check_tool_results(out)
    return out


def normalize_system(system: Any) -> str | list[dict[str, Any]] | None:
    """The request's `system`: a string, or a list of text blocks (None: absent)."""
    plain = to_plain(system)
    if plain is None or plain == "" or plain == []:
        return None
    if isinstance(plain, str):
        return plain
    if isinstance(plain, list):
        return [_block(b, f"system[{i}]") for i, b in enumerate(plain)]
    raise UsageError("system must be a string or a list of text blocks")


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tool definitions (`name`, `input_schema`; server tools by `type`)."""
    plain = to_plain(tools)
    if plain is None or plain == []:
        return None
    if not isinstance(plain, list):
        raise UsageError("tools must be a list of tool definitions")
    out = []
    for index, tool in enumerate(plain):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise UsageError(f"tools[{index}] must be an object with a name")
        out.append(_drop_nulls(tool))
    return out


def normalize_response(response: Any) -> dict[str, Any]:
    """The stored response: `role`, `content` blocks, `stop_reason`, `stop_sequence`.

    Takes a whole Messages response (its id, model and usage are the caller's
    to keep elsewhere), just its content blocks, or a plain string (one text block).
    """
    plain = to_plain(response)
    if isinstance(plain, str):
        plain = [{"type": "text", "text": plain}]
    if isinstance(plain, list):
        plain = {"content": plain}
    if not isinstance(plain, dict):
        raise UsageError("response must be a Messages response (an object with content)")
    if plain.get("type") == "error":
        raise UsageError("response is an error, not a message")
    message = {"role": "assistant", **{k: plain[k] for k in _RESPONSE_KEYS if k in plain}}
    if message["role"] != "assistant":
        raise UsageError(f"response.role is {message['role']!r}: a response is an assistant "
                         "message")
    return _message(_drop_nulls(message), "response")


def to_chat(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation in OpenAI chat shape (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text_content(
            [{"type": "text", "text": system}] if isinstance(system, str) else system)})
    for message in messages:
        out.extend(_chat_turns(message))
    return out


def chat_response(response: Mapping[str, Any]) -> dict[str, Any]:
    """The stored response as an assistant message in chat shape."""
    turns = _chat_turns({"role": "assistant", "content": response.get("content") or []})
    return turns[0] if turns else {"role": "assistant", "content": None}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool definitions in chat shape: custom tools as functions, server tools as they are."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if "input_schema" in tool or tool.get("type") in (None, "custom"):
            function = {"name": tool["name"], "description": tool.get("description"),
                        "parameters": tool.get("input_schema")}
            out.append({"type": "function", "function": _drop_nulls(function)})
        else:
            out.append(dict(tool))
    return out


def from_chat(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """(system, messages) of an Anthropic request meaning the chat conversation `messages`.

    The inverse of `to_chat` on what chat can say: system turns become
    `system`, tool calls `tool_use` blocks, tool turns `tool_result` blocks
    of the user turn that follows (turns of one role are merged, as the
    Messages API wants them alternating).
    """
    system = [m for m in messages if m.get("role") in ("system", "developer")]
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role in ("system", "developer"):
            continue
        blocks = blocks_of(message)
        role = "assistant" if role == "assistant" else "user"
        if out and out[-1]["role"] == role:
            out[-1]["content"] = _as_blocks(out[-1]["content"]) + blocks
        else:
            simple = len(blocks) == 1 and blocks[0]["type"] == "text" and role == "user"
            out.append({"role": role, "content": blocks[0]["text"] if simple else blocks})
    text = "\n\n".join(str(m.get("content") or "") for m in system)
    return (text or None), out


def response_from_chat(message: Mapping[str, Any], finish: str | None) -> dict[str, Any]:
    """The stored response for a chat-shaped assistant message and its finish reason."""
    stop = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
    reason = "tool_use" if message.get("tool_calls") else stop.get(finish or "stop", "end_turn")
    return {"role": "assistant", "content": blocks_of(message), "stop_reason": reason}


def blocks_of(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat message's content as Anthropic blocks (tool turns as one tool_result): the one
    conversion the store, the exports and the server share (arguments that spell no JSON
    object are kept as `{"arguments": text}`, see `tool_use_input`)."""
    content = message.get("content")
    if message.get("role") == "tool":
        block: dict[str, Any] = {"type": "tool_result", "tool_use_id": message["tool_call_id"],
                                 "content": content if content is not None else ""}
        if message.get("is_error"):
            block["is_error"] = True
        return [block]
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    if isinstance(content, str) and content:
        blocks.append({"type": "text", "text": content})
    elif isinstance(content, list):
        blocks.extend(dict(p) for p in content)
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        blocks.append({"type": "tool_use", "id": call.get("id") or "",
                       "name": function.get("name", ""),
                       "input": tool_use_input(function.get("arguments"))})
    return blocks


def tool_input(arguments: Any) -> dict[str, Any] | None:
    """The JSON object a tool call's arguments spell (a string of JSON, or the value itself),
    None when they spell none: a `tool_use` input must be an object. No arguments: `{}`."""
    if arguments is None or arguments == "":
        return {}
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def tool_use_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as a stored `tool_use` input: the object they spell, else
    `{"arguments": the text as it was}`, so that nothing the call said is lost."""
    value = tool_input(arguments)
    return value if value is not None else {"arguments": arguments}


def _as_blocks(content: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def finish_reason(response: Mapping[str, Any]) -> str | None:
    """The response's stop reason in OpenAI's vocabulary (None when it has none)."""
    reason = response.get("stop_reason")
    return FINISH_REASONS.get(reason, reason) if isinstance(reason, str) else None


def _chat_turns(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results first (one `tool` turn each)."""
    role = message["role"]
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    turns: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content or []:
        kind = block.get("type")
        if kind == "tool_result":
            turn = {"role": "tool", "tool_call_id": block["tool_use_id"],
                    "content": _result_content(block.get("content"))}
            if block.get("is_error"):
                turn["is_error"] = True
            turns.append(turn)
        elif kind == "tool_use":
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"],
                "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        elif kind == "thinking":
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        else:
            parts.append({k: v for k, v in block.items() if k != "cache_control"})
    if parts or calls or reasoning or not turns:
        turn = {"role": role, "content": _text_content(parts) if parts else None}
        if calls:
            turn["tool_calls"] = calls
        if reasoning:
            turn["reasoning_content"] = "".join(reasoning)
        turns.append(turn)
    return turns


def _text_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """One text part as a plain string; otherwise the parts (text parts without cache_control)."""
    clean = [{"type": "text", "text": p["text"]} if p.get("type") == "text" else p for p in parts]
    if len(clean) == 1 and clean[0].get("type") == "text":
        return str(clean[0]["text"])
    return clean


def _result_content(content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content if content is not None else ""
    return _text_content([dict(b) for b in content])


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise UsageError(f"{where} must be an object with role and content")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise UsageError(f"{where}.role is {role!r}: use user or assistant")
    out = _drop_nulls(message)
    content = message.get("content")
    if isinstance(content, str):
        return out
    if not isinstance(content, list):
        raise UsageError(f"{where}.content must be a string or a list of content blocks")
    out["content"] = [_block(b, f"{where}.content[{i}]") for i, b in enumerate(content)]
    return out


def _block(block: Any, where: str) -> dict[str, Any]:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise UsageError(f"{where} must be a content block with a type")
    kind = block["type"]
    for field in _FIELDS.get(kind, ()):
        if not isinstance(block.get(field), str):
            raise UsageError(f"{where}: a {kind} block needs {field} (a string)")
    if kind in ("tool_use", "server_tool_use") and not isinstance(block.get("input", {}), dict):
        raise UsageError(f"{where}.input must be an object")
    if kind == "tool_result":
        inner = block.get("content")
        if inner is not None and not isinstance(inner, (str, list)):
            raise UsageError(f"{where}.content must be a string or a list of blocks")
        if isinstance(inner, list):
            for i, b in enumerate(inner):
                _block(b, f"{where}.content[{i}]")
        if "is_error" in block and not isinstance(block["is_error"], (bool, type(None))):
            raise UsageError(f"{where}.is_error must be true or false")
    return _drop_nulls(block)


def _check_tool_results(messages: list[dict[str, Any]]) -> None:
    """Every `tool_result` answers a `tool_use` of an earlier assistant turn."""
    asked: set[str] = set()
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for position, block in enumerate(content):
            if block["type"] == "tool_use" and message["role"] == "assistant":
                asked.add(block["id"])
            elif block["type"] == "tool_result" and block["tool_use_id"] not in asked:
                raise UsageError(
                    f"messages[{index}].content[{position}]: tool_result for "
                    f"{block['tool_use_id']!r} answers no tool_use of an earlier assistant turn")


def _drop_nulls(value: Mapping[str, Any]) -> dict[str, Any]:
    return {key: item for key, item in value.items() if item is not None}


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
