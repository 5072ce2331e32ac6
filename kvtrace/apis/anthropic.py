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

Its streamed events are read and written by anthropic_stream.py, whose
`assemble`, `stream_bytes` and `stream_events` this module offers too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvtrace.apis.anthropic_stream import assemble as assemble
from kvtrace.apis.anthropic_stream import stream_bytes as stream_bytes
from kvtrace.apis.anthropic_stream import stream_events as stream_events
from kvtrace.apis.plain import to_plain
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
