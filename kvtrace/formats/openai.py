"""OpenAI chat messages: the conversation that many harnesses save (tau-bench, mini-swe-agent).

The document is a JSON list of chat messages, or an object with `messages`
and optional `tools` and `model` (its other keys are kept). Import:

- each assistant message becomes a model_call step whose messages are the
  ones before it and whose response is it (model: the document's `model`,
  else "unknown"; tools: the document's `tools`);
- each `role: "tool"` message with a `tool_call_id` becomes a tool_call step
  linked by that id (`call_id`), with the name and arguments of the matching
  `tool_calls` entry of an earlier assistant message;
- messages after the last assistant message are in no prompt: the last
  model call keeps them in `meta.extra.openai.tail` (a tool result's content
  is its tool_call step), the first keeps the document's other keys in
  `meta.extra.openai.root`.

Export gives the document back: the last model call's messages and
response, then the tool results recorded after it, and the tools list.
Messages come back in kvtrace's normal form (null-valued keys other than
`content` dropped, tool-call arguments as JSON text; docs/formats.md).
"""

from __future__ import annotations

from typing import Any

from kvtrace.errors import UsageError
from kvtrace.formats.records import (
    UNKNOWN_MODEL,
    ModelCall,
    Record,
    ToolCall,
    check_storable,
    keep,
    record,
    restore,
    tools,
)
from kvtrace.rendering import parse_arguments, tool_result_content
from kvtrace.store import RunInfo, Step, Store, kinds
from kvtrace.store.messages import normalize_message, normalize_response

ROOT_MAPPED = frozenset({"messages", "tools", "model"})


def import_openai(store: Store, document: Any, *, run: str) -> RunInfo:
    """Record an OpenAI message list (or `{"messages", "tools"}` object) as the new run `run`."""
    return record(store, run, openai_records(document))


def openai_records(document: Any) -> list[Record]:
    """The steps a document becomes, every element checked first (see the module docstring)."""
    check_storable(document)
    if isinstance(document, list):
        messages, root = document, None
    elif isinstance(document, dict) and isinstance(document.get("messages"), list):
        messages, root = document["messages"], document
    else:
        raise UsageError(
            "messages: missing: an openai document is a list of chat messages "
            "or an object with 'messages'"
        )
    model = root.get("model", UNKNOWN_MODEL) if root else UNKNOWN_MODEL
    if not isinstance(model, str) or not model:
        raise UsageError("model must name the model (a non-empty string)")
    tool_list = tools(root.get("tools"), "tools") if root else None
    for index, item in enumerate(messages):
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise UsageError(f"messages[{index}] is not a chat message (an object with a role)")
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers:
        raise UsageError("messages: no assistant message, so there is no model call to import")
    last = answers[-1]
    stored = [normalize_message(m, f"messages[{i}]") for i, m in enumerate(messages[: last + 1])]

    # The first call keeps the document's own keys, the last the messages no prompt carries.
    first_kept = {"root": keep(root, ROOT_MAPPED)} if root is not None else {"form": "list"}
    tail = [
        {k: v for k, v in m.items() if k != "content"} if _is_linked(m) else m
        for m in messages[last + 1 :]
    ]
    records: list[Record] = []
    calls: dict[str, dict[str, Any]] = {}
    for index, item in enumerate(messages):
        if item["role"] == "assistant":
            kept = {**(first_kept if index == answers[0] else {}),
                    **({"tail": tail} if index == last and tail else {})}
            records.append(ModelCall(stored[:index], stored[index], model, tool_list,
                                     extra={"openai": kept} if kept else {}))
            calls.update({c["id"]: c for c in stored[index].get("tool_calls", []) if "id" in c})
        elif _is_linked(item):
            call_id = item["tool_call_id"]
            call = calls.get(call_id) if isinstance(call_id, str) else None
            if call is None:
                raise UsageError(
                    f"messages[{index}]: tool_call_id {call_id!r} matches no tool call "
                    "of an earlier assistant message"
                )
            function = call["function"]
            records.append(ToolCall(function["name"], parse_arguments(function["arguments"]),
                                    item.get("content"), call_id=call_id))
    return records


def _is_linked(message: dict[str, Any]) -> bool:
    """A tool result that names the call it answers (it becomes a tool_call step)."""
    return message["role"] == "tool" and message.get("tool_call_id") is not None


def export_openai(store: Store, spec: str) -> Any:
    """The conversation up to `spec` as an OpenAI document (the form it was imported in)."""
    path = store.path(spec)
    calls = [i for i, s in enumerate(path) if s.kind == kinds.StepKind.MODEL_CALL]
    if not calls:
        raise UsageError(f"{spec} has no model call: there is no conversation to export")
    first, last = path[calls[0]], kinds.ModelCall(path[calls[-1]])
    messages = [
        *last.messages,
        normalize_response(last.response),
        *_tail(_kept(last).get("tail"), path[calls[-1] + 1 :]),
    ]
    if _kept(kinds.ModelCall(first)).get("form") == "list":
        return messages
    mapped = {"model": last.model, "tools": last.tools, "messages": messages}
    return restore(mapped, _kept(kinds.ModelCall(first)).get("root"))


def _tail(kept: Any, after: list[Step]) -> list[dict[str, Any]]:
    """The messages after the last response: the kept tail, with tool results from their steps."""
    results = kinds.tool_calls(after)
    by_id = {s.call_id: s for s in results if s.call_id}
    out: list[dict[str, Any]] = []
    used: set[str] = set()
    for item in kept if isinstance(kept, list) else []:
        call_id = item.get("tool_call_id")
        if item.get("role") == "tool" and "content" not in item:
            tool = by_id.get(call_id)
            used.add(call_id)
            content = tool_result_content(tool.result, tool.error) if tool else None
            out.append({**item, "content": content})
        else:
            out.append(dict(item))
    for tool in results:
        call_id = tool.call_id
        if call_id in used:
            continue
        head = {"tool_call_id": call_id} if call_id else {"name": tool.tool}
        out.append({"role": "tool", **head,
                    "content": tool_result_content(tool.result, tool.error)})
    return out


def _kept(call: kinds.ModelCall) -> dict[str, Any]:
    kept = call.extra.get("openai")
    return kept if isinstance(kept, dict) else {}

