"""OpenAI Responses calls: their own shape checked, and the chat conversation they mean.

A model call spoken in the Responses API (Codex, the OpenAI Agents SDK, the
`openai` package's `responses.create`) is stored as it was sent
(docs/store.md, "Three APIs"): the `input` items one by one (a string input
is the one user message it stands for), `instructions` and `tools` as
payload fields, and the response's `output` items with its `status`. A
request that continues a stored response by `previous_response_id` is
stored with that response's conversation in front of its own items, so a
step always holds its whole conversation (`extra.previous_items` says how
many items came from there). What analyze, replay, diff, report and export
read is the same call in OpenAI chat shape, derived here by one pure
function:

- `instructions` becomes a first system message; `message` items keep
  their role, `input_text` / `output_text` parts become text parts (one
  part: the content string);
- the model's items in a row (assistant messages, reasoning, calls, the
  rest) are one assistant turn, in input as in a response, so the two read
  alike: texts joined as parts, `function_call` and `custom_tool_call` items
  its `tool_calls` (a custom tool's free-form `input` is its arguments
  string), reasoning summaries its `reasoning_content` (`encrypted_content`
  lives only in the stored items); `*_output` items become `tool` messages;
- items of other types (web search, computer, shell, MCP calls...) become
  content parts of their own type on an assistant turn: kept, not rendered.

Its streamed events are read and written by responses_stream.py, whose
`assemble`, `stream_bytes` and `stream_events` this module offers too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvtrace.apis.plain import to_plain
from kvtrace.apis.responses_stream import assemble as assemble
from kvtrace.apis.responses_stream import stream_bytes as stream_bytes
from kvtrace.apis.responses_stream import stream_events as stream_events
from kvtrace.errors import UsageError

ROLES = frozenset({"system", "developer", "user", "assistant"})
# Request fields that are not parameters: the input, instructions, tools, model, streaming.
NOT_PARAMS = frozenset({"input", "instructions", "tools", "model", "stream", "stream_options"})
_CALLS = frozenset({"function_call", "custom_tool_call"})
# Calls whose output comes back as a function_call_output, though they are no function call:
# the built-in local shell (Codex on codex-mini), answered with its call_id.
_ANSWERABLE = _CALLS | {"local_shell_call"}
_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_RESPONSE_KEYS = ("output", "status", "incomplete_details")
FINISH_REASONS = {"completed": "stop", "incomplete": "length", "failed": "error"}


def normalize_input(items: Any, prior: Iterable[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The request's `input` in stored form: a list of items, checked, nulls dropped.

    `prior` holds the items that come before it (a previous response's
    conversation): an output item must answer a call made in one or the other.
    """
    plain = to_plain(items)
    if isinstance(plain, str):
        plain = [{"type": "message", "role": "user", "content": plain}]
    if not isinstance(plain, list):
        raise UsageError("input must be a string or a list of Responses input items")
    out = [_item(item, f"input[{i}]") for i, item in enumerate(plain)]
    called = {str(i.get("call_id")) for i in prior if i.get("type") in _ANSWERABLE}
    for index, item in enumerate(out):
        if item["type"] in _ANSWERABLE and isinstance(item.get("call_id"), str):
            called.add(item["call_id"])
        elif item["type"] in _OUTPUTS and item["call_id"] not in called:
            raise UsageError(f"input[{index}]: {item['type']} for {item['call_id']!r} answers "
                             "no function call made before it")
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tool definitions (function tools by name; hosted tools by type)."""
    plain = to_plain(tools)
    if plain is None or plain == []:
        return None
    if not isinstance(plain, list):
        raise UsageError("tools must be a list of tool definitions")
    out = []
    for index, tool in enumerate(plain):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise UsageError(f"tools[{index}] must be an object with a type")
        if tool["type"] in ("function", "custom") and not (
                isinstance(tool.get("name"), str) and tool["name"]):
            raise UsageError(f"tools[{index}] needs a name")
        out.append(_drop_nulls(tool))
    return out


def normalize_response(response: Any) -> dict[str, Any]:
    """The stored response: its `output` items, `status` and `incomplete_details`.

    Takes a whole Responses object (its id, model and usage are the caller's to
    keep elsewhere) or just its list of output items.
    """
    plain = to_plain(response)
    if isinstance(plain, list):
        plain = {"output": plain}
    if not isinstance(plain, dict) or not isinstance(plain.get("output"), list):
        raise UsageError("response must be a Responses object with a list of output items")
    out = _drop_nulls({k: plain.get(k) for k in _RESPONSE_KEYS})
    out["output"] = [_item(item, f"response.output[{i}]") for i, item in enumerate(out["output"])]
    return out


def to_chat(instructions: Any, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation in OpenAI chat shape (see the module docstring).

    The one rule for the model's items: every run of them between two other messages (a
    user turn, a tool output) is one assistant turn, in order: texts joined as parts, calls
    as `tool_calls`, reasoning summaries as `reasoning_content`. A response's `output` is
    such a run, so a response (`chat_response`) and the same items sent back as input
    render to the same bytes, whatever their order (tests/replay/test_api_views.py).
    """
    out: list[dict[str, Any]] = []
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    reasoning: list[str] = []  # summaries waiting for the assistant turn they open
    for item in items:
        kind = item["type"]
        if kind in _OUTPUTS:
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _content(item.get("output"))})
            continue
        if kind == "message" and item["role"] != "assistant":
            out.append({"role": item["role"], "content": _content(item.get("content"))})
            continue
        if kind == "reasoning":
            reasoning.extend(str(s.get("text", "")) for s in item.get("summary") or []
                             if isinstance(s, Mapping))
            if not (out and out[-1]["role"] == "assistant"):
                continue  # it opens the next assistant turn
        turn = out[-1] if out and out[-1]["role"] == "assistant" else None
        if turn is None:
            turn = {"role": "assistant", "content": None}
            out.append(turn)
        if reasoning:
            turn["reasoning_content"] = turn.get("reasoning_content", "") + "".join(reasoning)
            reasoning = []
        if kind == "message":
            turn["content"] = _joined(turn["content"], _content(item.get("content")))
        elif kind in _CALLS:
            arguments = item.get("arguments") if kind == "function_call" else item.get("input")
            turn.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": str(arguments or "")}})
        elif kind != "reasoning":
            turn["content"] = _joined(turn["content"], [dict(item)])
    if reasoning:
        out.append({"role": "assistant", "content": None, "reasoning_content": "".join(reasoning)})
    return out


def chat_response(response: Mapping[str, Any]) -> dict[str, Any]:
    """The stored response's output items as one assistant message in chat shape: the turn
    `to_chat` makes of them (output items are all the model's)."""
    turns = to_chat(None, list(response.get("output") or []))
    return turns[0] if len(turns) == 1 else {"role": "assistant", "content": None}


def _joined(content: Any, more: Any) -> Any:
    """Two contents of one assistant turn, in order: `more` alone when there is no text yet,
    else text parts (a string is one text part) followed by `more`'s."""
    if content is None or content == "":
        return more

    def parts(value: Any) -> list[dict[str, Any]]:
        return [{"type": "text", "text": value}] if isinstance(value, str) else list(value)

    return [*parts(content), *parts(more)]


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool definitions in chat shape: function tools wrapped, hosted tools as they are."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if tool["type"] == "function":
            function = {k: v for k, v in tool.items() if k != "type"}
            out.append({"type": "function", "function": function})
        elif tool["type"] == "custom":
            function = {"name": tool["name"], "description": tool.get("description")}
            out.append({"type": "function", "function": _drop_nulls(function)})
        else:
            out.append(dict(tool))
    return out


def from_chat(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """(instructions, input items) of a Responses request meaning the chat conversation.

    The inverse of `to_chat` on what chat can say: a first system turn
    becomes `instructions`, tool calls `function_call` items, tool turns
    `function_call_output` items.
    """
    instructions = None
    if messages and messages[0].get("role") == "system" and isinstance(
            messages[0].get("content"), str):
        instructions, messages = messages[0]["content"], messages[1:]
    items: list[dict[str, Any]] = []
    for message in messages:
        items.extend(items_of(message))
    return instructions, items


def response_from_chat(message: Mapping[str, Any], finish: str | None) -> dict[str, Any]:
    """The stored response for a chat-shaped assistant message and its finish reason."""
    status = "incomplete" if finish == "length" else "completed"
    return {"output": items_of({**message, "role": "assistant"}), "status": status}


def items_of(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One chat message as Responses items: the one conversion the store, the exports and
    the server share (an assistant's reasoning, its text as one output message, its calls)."""
    role = message.get("role")
    content = message.get("content")
    if role == "tool":
        return [{"type": "function_call_output", "call_id": message["tool_call_id"],
                 "output": content if content is not None else ""}]
    if role != "assistant":
        return [{"type": "message", "role": role, "content": content}]
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "summary": [
            {"type": "summary_text", "text": message["reasoning_content"]}]})
    parts = _output_parts(content)
    if parts:
        items.append({"type": "message", "role": "assistant", "content": parts})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        items.append({"type": "function_call", "call_id": call.get("id") or "",
                      "name": function.get("name", ""),
                      "arguments": function.get("arguments") or ""})
    return items


def _output_parts(content: Any) -> list[dict[str, Any]]:
    """An assistant's content as output parts: text as `output_text`, other parts as they are."""
    if isinstance(content, str):
        return [{"type": "output_text", "text": content}] if content else []
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else []:
        if isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS:
            if part.get("text"):
                parts.append({"type": "output_text", "text": part["text"]})
        elif isinstance(part, Mapping):
            parts.append(dict(part))
    return parts


def finish_reason(response: Mapping[str, Any]) -> str | None:
    """The response's status in OpenAI chat's finish_reason vocabulary."""
    output = response.get("output") or []
    if any(isinstance(i, Mapping) and i.get("type") in _CALLS for i in output):
        return "tool_calls"
    status = response.get("status")
    return FINISH_REASONS.get(status, status) if isinstance(status, str) else None


def _content(content: Any) -> Any:
    """Message content in chat shape: text parts as `text` parts, one of them as a string."""
    if content is None or isinstance(content, str):
        return content if content is not None else ""
    parts = [{"type": "text", "text": p.get("text", "")} if p.get("type") in _TEXT_PARTS
             else dict(p) for p in content if isinstance(p, Mapping)]
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise UsageError(f"{where} must be an object (a Responses item)")
    out = _drop_nulls(item)
    if "type" not in out and "role" in out:
        out["type"] = "message"  # an "easy" input message: the same item
    kind = out.get("type")
    if not isinstance(kind, str):
        raise UsageError(f"{where} must have a type")
    if kind == "message":
        role = out.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise UsageError(f"{where}.role is {out.get('role')!r}: use one of "
                             f"{', '.join(sorted(ROLES))}")
        content = out.get("content")
        if not isinstance(content, (str, list)) or (isinstance(content, list) and not all(
                isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)):
            raise UsageError(f"{where}.content must be a string or a list of typed parts")
    elif kind in _CALLS or kind in _OUTPUTS:
        if not isinstance(out.get("call_id"), str) or not out["call_id"]:
            raise UsageError(f"{where}: a {kind} item needs a call_id")
        if kind in _CALLS and not (isinstance(out.get("name"), str) and out["name"]):
            raise UsageError(f"{where}: a {kind} item needs a name")
        if kind == "function_call" and not isinstance(out.get("arguments"), str):
            raise UsageError(f"{where}.arguments must be a JSON string")
        if kind in _OUTPUTS and not isinstance(out.get("output"), (str, list)):
            raise UsageError(f"{where}.output must be a string or a list of parts")
    elif kind == "reasoning" and not isinstance(out.get("summary", []), list):
        raise UsageError(f"{where}.summary must be a list")
    return out


def _drop_nulls(value: Mapping[str, Any]) -> dict[str, Any]:
    return {key: item for key, item in value.items() if item is not None}
