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

Streaming. A streamed response is a sequence of typed events, each with a
`sequence_number` that grows by one: `response.created` (and
`response.in_progress`, `response.queued`) carry the response so far;
each output item comes as `response.output_item.added`, the events that
build it (`response.content_part.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, `response.custom_tool_call_input.delta`,
`response.reasoning_summary_text.delta`, their `.done` twins...) and
`response.output_item.done` with the finished item; the stream ends with
`response.completed`, `response.incomplete` or `response.failed`, whose
`response` is the whole final response.

`assemble` turns a stream into the response it adds up to: the terminal
event's response when it arrived (it is the provider's own summary),
else the response of `response.created` with the items built so far.
`stream_bytes` writes a response as such a stream (what a replay sends for
a call recorded without streaming). The outcomes that are not a plain
response:

- an event type outside the `response.` family is skipped and named in
  `unknown_events`; events of the family this module does not build items
  from (annotations, web search progress...) change nothing, since the
  items' `done` events and the terminal response carry their outcome;
- an `error` event ends the stream with `error` set: no response to record;
  `response.failed` is a response (its `status` and `error` say why);
- no terminal event: `is_finished` is false, the response has what arrived;
- data that is not JSON, a sequence number that does not grow, or an item
  event before its item's start raises ValueError.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kvtrace.apis.plain import to_plain
from kvtrace.apis.sse import Assembled, encode_event, json_events
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


TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
            "failed": "response.failed"}
_STARTS = frozenset({"response.created", "response.in_progress", "response.queued"})
# Delta events: the item field (or content part field) each one extends.
_ITEM_DELTAS = {"response.function_call_arguments.delta": "arguments",
                "response.custom_tool_call_input.delta": "input"}
_PART_DELTAS = {"response.output_text.delta": "text", "response.refusal.delta": "refusal"}


def assemble(data: bytes) -> Assembled:
    """The response a Responses SSE stream adds up to (see the module docstring)."""
    response: dict[str, Any] | None = None
    items: dict[int, dict[str, Any]] = {}
    unknown: list[str] = []
    last = -1
    for event in json_events(data):
        kind = str(event.get("type"))
        number = event.get("sequence_number")
        if isinstance(number, int) and not isinstance(number, bool):
            if number <= last:
                raise ValueError(f"sequence_number {number} after {last}")
            last = number
        if kind == "error":
            error = {k: v for k, v in event.items() if k not in ("type", "sequence_number")}
            return Assembled(response or {}, False, error, tuple(unknown))
        if kind in TERMINAL.values():
            return Assembled(dict(_object(event.get("response"), kind)), True, None,
                             tuple(unknown))
        if kind in _STARTS:
            response = dict(_object(event.get("response"), kind))
        elif not kind.startswith("response."):
            unknown.append(kind)
        elif kind in ("response.output_item.added", "response.output_item.done"):
            items[_index(event, "output_index")] = dict(_object(event.get("item"), kind))
        elif kind in _ITEM_DELTAS or kind in _PART_DELTAS or kind in (
                "response.content_part.added", "response.reasoning_summary_part.added",
                "response.reasoning_summary_text.delta"):
            _build(items, kind, event)
    if response is None:
        raise ValueError("the stream has no response.created")
    return Assembled({**response, "output": [items[i] for i in sorted(items)]}, False, None,
                     tuple(unknown))


def stream_bytes(response: Mapping[str, Any]) -> bytes:
    """SSE bytes of a response: created, each item built in one delta, the terminal event."""
    return b"".join(encode_event(event) for event in stream_events(response))


def stream_events(response: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The events of `stream_bytes`, as JSON objects, numbered from 0."""
    number = iter(range(1 << 62))
    start = {**response, "status": "in_progress", "output": [], "usage": None,
             "incomplete_details": None}
    for kind in ("response.created", "response.in_progress"):
        yield {"type": kind, "sequence_number": next(number), "response": start}
    for index, item in enumerate(response.get("output") or []):
        for event in _item_events(index, item):
            yield {**event, "sequence_number": next(number)}
    terminal = TERMINAL.get(str(response.get("status")), TERMINAL["completed"])
    yield {"type": terminal, "sequence_number": next(number), "response": dict(response)}


def _item_events(index: int, item: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    kind = item.get("type")
    where = {"item_id": item.get("id"), "output_index": index}
    head = {**item, "status": "in_progress"} if "status" in item else dict(item)
    if kind == "message":
        head["content"] = []
    elif kind == "function_call":
        head["arguments"] = ""
    elif kind == "custom_tool_call":
        head["input"] = ""
    yield {"type": "response.output_item.added", "output_index": index, "item": head}
    if kind == "message":
        for number, part in enumerate(item.get("content") or []):
            field = "text" if part.get("type") == "output_text" else (
                "refusal" if part.get("type") == "refusal" else None)
            at = {**where, "content_index": number}
            empty = {**part, field: ""} if field else dict(part)
            yield {"type": "response.content_part.added", **at, "part": empty}
            if field:
                name = "output_text" if field == "text" else "refusal"
                logprobs: dict[str, list[Any]] = {"logprobs": []} if field == "text" else {}
                yield {"type": f"response.{name}.delta", **at, "delta": part.get(field, ""),
                       **logprobs}
                yield {"type": f"response.{name}.done", **at, field: part.get(field, ""),
                       **logprobs}
            yield {"type": "response.content_part.done", **at, "part": dict(part)}
    elif kind == "function_call":
        arguments = item.get("arguments", "")
        yield {"type": "response.function_call_arguments.delta", **where, "delta": arguments}
        yield {"type": "response.function_call_arguments.done", **where,
               "name": item.get("name"), "arguments": arguments}
    elif kind == "custom_tool_call":
        text = item.get("input", "")
        yield {"type": "response.custom_tool_call_input.delta", **where, "delta": text}
        yield {"type": "response.custom_tool_call_input.done", **where, "input": text}
    yield {"type": "response.output_item.done", "output_index": index, "item": dict(item)}


def _build(items: dict[int, dict[str, Any]], kind: str, event: Mapping[str, Any]) -> None:
    """Apply one event that builds an item already started."""
    index = _index(event, "output_index")
    if index not in items:
        raise ValueError(f"a {kind} event for output item {index} before its start")
    item = items[index]
    if kind in _ITEM_DELTAS:
        field = _ITEM_DELTAS[kind]
        item[field] = str(item.get(field) or "") + _string(event.get("delta"), kind)
        return
    if kind == "response.reasoning_summary_part.added":
        item["summary"] = [*(item.get("summary") or []), dict(_object(event.get("part"), kind))]
        return
    if kind == "response.reasoning_summary_text.delta":
        summary = item.get("summary") or []
        at = _index(event, "summary_index")
        if at >= len(summary):
            raise ValueError(f"a {kind} event before its summary part")
        summary[at] = {**summary[at], "text": str(summary[at].get("text") or "")
                       + _string(event.get("delta"), kind)}
        return
    parts = item.setdefault("content", [])
    at = _index(event, "content_index")
    if kind == "response.content_part.added":
        parts[at:at + 1] = [dict(_object(event.get("part"), kind))]
        return
    if at >= len(parts):
        raise ValueError(f"a {kind} event before its content part")
    field = _PART_DELTAS[kind]
    parts[at] = {**parts[at], field: str(parts[at].get(field) or "")
                 + _string(event.get("delta"), kind)}


def _index(event: Mapping[str, Any], key: str) -> int:
    value = event.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a {event.get('type')} event without an integer {key}")
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: the response or item is not a JSON object")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"a {where} event without its string delta")
    return value
