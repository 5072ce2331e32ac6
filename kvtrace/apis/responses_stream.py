"""Server-sent events of OpenAI's Responses API: assembled into what they add up to, and written.

A streamed response is a sequence of typed events, each with a
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

from collections.abc import Iterator, Mapping
from typing import Any

from kvtrace.apis.sse import Assembled, encode_event, json_events

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
