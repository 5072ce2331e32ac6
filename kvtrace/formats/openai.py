"""OpenAI chat messages: the conversation that many harnesses save (tau-bench, mini-swe-agent).

The document is a JSON list of chat messages, or an object with `messages`
and optional `tools` and `model` (its other keys are kept). Import:

- each assistant message becomes a model_call step whose messages are the
  ones before it and whose response is it (tools: the document's `tools`);
  its model and usage are the provider's own when the message keeps the
  provider's raw response, as mini-swe-agent v2 does in `extra.response`
  (`model`, `usage` with `prompt_tokens_details.cached_tokens` and
  DeepSeek's `prompt_cache_hit_tokens`: analyze sets them against its
  oracle bound); else the model is the document's `model`, mini-swe-agent's
  `info.config.model.model_name`, or "unknown", and there is no usage;
- each `role: "tool"` message whose `tool_call_id` names a call of an
  earlier assistant message (the latest with that id) becomes a tool_call
  step linked by that id (`call_id`), with that call's name and arguments; a
  tool message naming no call (a trimmed conversation, as the server
  records it) stays a message of the conversation, with no step;
- messages after the last assistant message are in no prompt: the last
  model call keeps them in `meta.extra.openai.tail` (a tool result's content
  is its tool_call step), the first keeps the document's other keys in
  `meta.extra.openai.root`.

Every message is checked as the store checks it (`normalize_message`: the
server and `record_model_call` take the same rule), those after the last
answer too, so what one path accepts the others accept: an export imports
back. One assistant message cannot use a tool-call id twice.

Export gives the document back: the last model call's messages and
response, then the tool results recorded after it, and the tools list.
Messages come back in kvtrace's normal form (null-valued keys other than
`content` dropped, tool-call arguments as JSON text; docs/formats.md).
"""

from __future__ import annotations

from typing import Any

from kvtrace.apis.chat import ROLES, normalize_message, normalize_response, tool_calls_of
from kvtrace.errors import UsageError
from kvtrace.formats.records import (
    UNKNOWN_MODEL,
    Answers,
    ModelCallRecord,
    Record,
    ToolCallRecord,
    arguments_value,
    check_storable,
    keep,
    record,
    restore,
    tools,
)
from kvtrace.rendering import tool_result_content
from kvtrace.store import OnStep, RunInfo, Step, Store, kinds

ROOT_MAPPED = frozenset({"messages", "tools"})  # a root `model` is kept as written


def import_openai(store: Store, document: Any, *, run: str,
                  on_step: OnStep | None = None) -> RunInfo:
    """Record an OpenAI message list (or `{"messages", "tools"}` object) as the new run `run`."""
    return record(store, run, openai_records(document), on_step=on_step)


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
    model = root.get("model", _configured_model(root)) if root else UNKNOWN_MODEL
    if not isinstance(model, str) or not model:
        raise UsageError("model must name the model (a non-empty string)")
    tool_list = tools(root.get("tools"), "tools") if root else None
    for index, item in enumerate(messages):
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise UsageError(f"messages[{index}] is not a chat message (an object with a role)")
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    last = answers[-1] if answers else -1
    stored = [_normalized(m, f"messages[{i}]", is_tail=i > last) for i, m in enumerate(messages)]
    if not answers:
        raise UsageError("messages: no assistant message, so there is no model call to import")

    # The first call keeps the document's own keys, the last the messages no prompt carries.
    first_kept = {"root": keep(root, ROOT_MAPPED)} if root is not None else {"form": "list"}
    answering = _answered_calls(stored)
    tail = [_tail_item(item, stored[i], is_answer=i in answering)
            for i, item in enumerate(messages) if i > last]
    records: list[Record] = []
    sent = None  # where the previous call's messages end: each call continues it
    for index, item in enumerate(stored):
        if item["role"] == "assistant":
            kept = {**(first_kept if index == answers[0] else {}),
                    **({"tail": tail} if index == last and tail else {})}
            raw = _raw_response(messages[index])
            records.append(ModelCallRecord(stored[sent or 0:index], item, raw.get("model", model),
                                           tool_list, usage=raw.get("usage"),
                                           extra={"openai": kept} if kept else {},
                                           continues=sent is not None))
            sent = index
        elif index in answering:
            function = answering[index]["function"]
            records.append(ToolCallRecord(function["name"], arguments_value(function["arguments"]),
                                          item["content"], call_id=item["tool_call_id"]))
    return records


def _raw_response(message: dict[str, Any]) -> dict[str, Any]:
    """The model and usage of the provider's raw response a message keeps (mini-swe-agent v2's
    `extra.response`), those that are well formed; {} when it keeps none."""
    extra = message.get("extra")
    raw = extra.get("response") if isinstance(extra, dict) else None
    if not isinstance(raw, dict):
        return {}
    found: dict[str, Any] = {}
    if isinstance(raw.get("model"), str) and raw["model"]:
        found["model"] = raw["model"]
    if isinstance(raw.get("usage"), dict) and raw["usage"]:
        found["usage"] = raw["usage"]
    return found


def _configured_model(root: dict[str, Any]) -> str:
    """The model a mini-swe-agent trajectory was configured with (`info.config.model`)."""
    config = (root.get("info") or {}).get("config") if isinstance(root.get("info"), dict) else None
    model = (config or {}).get("model") if isinstance(config, dict) else None
    name = model.get("model_name") if isinstance(model, dict) else None
    return name if isinstance(name, str) and name else UNKNOWN_MODEL


def _answered_calls(messages: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The tool call each tool result answers (by message index): the latest with its id.

    A tool message whose id matches no earlier call (a client that trimmed the
    conversation; the server records such requests as they come) answers
    none: it stays a message of the conversation, and no tool_call step.
    """
    calls: dict[str, dict[str, Any]] = {}
    answering: dict[int, dict[str, Any]] = {}
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            calls.update({call["id"]: call for call in tool_calls_of(message) if "id" in call})
        elif message["role"] == "tool" and message.get("tool_call_id") in calls:
            answering[index] = calls[message["tool_call_id"]]
    return answering


def _tail_item(message: dict[str, Any], stored: dict[str, Any], *, is_answer: bool
               ) -> dict[str, Any]:
    """A message after the last answer as kept: a tool result's content, when its
    tool_call step gives it back, is left to the step (so an edited fork exports its edit)."""
    if is_answer and tool_result_content(stored["content"]) == stored["content"]:
        return {key: value for key, value in message.items() if key != "content"}
    return message


def _normalized(message: dict[str, Any], where: str, *, is_tail: bool) -> dict[str, Any]:
    """A message in the stored form; after the last answer a role kvtrace does not know
    (mini-swe-agent's `exit`) is kept, its other fields checked as a user message's."""
    if is_tail and message["role"] not in ROLES:
        return {**normalize_message({**message, "role": "user"}, where),
                "role": message["role"]}
    return normalize_message(message, where)


def export_openai(store: Store, spec: str, *, on_step: OnStep | None = None) -> Any:
    """The conversation up to `spec` as an OpenAI document (the form it was imported in).

    Read as the run is walked without conversations, keeping only the first and
    last model calls and the steps after the last; the last call is then read
    whole: a long run costs one pass and one conversation, not n of them.
    """
    first: Step | None = None
    last_step: Step | None = None
    after: list[Step] = []
    for step in store.walk(spec, on_step=on_step, lists=False):
        if step.kind == kinds.StepKind.MODEL_CALL:
            first, last_step, after = first or step, step, []
        else:
            after.append(step)
    if first is None or last_step is None:
        raise UsageError(f"{spec} has no model call: there is no conversation to export")
    last = kinds.ModelCall(store.show(last_step.id))
    messages = [
        *last.messages,
        normalize_response(last.response),
        *_tail(_kept(last).get("tail"), after),
    ]
    if _kept(kinds.ModelCall(first)).get("form") == "list":
        return messages
    mapped = {"model": last.model, "tools": last.tools, "messages": messages}
    return restore(mapped, _kept(kinds.ModelCall(first)).get("root"))


def _tail(kept: Any, after: list[Step]) -> list[dict[str, Any]]:
    """The messages after the last response: the kept tail, with tool results from their steps.

    A kept tool result takes the next tool step answering its call, in order
    (a call may be answered twice); its content comes from that step unless
    the content was kept. Tool steps no kept message takes follow.
    """
    answers = Answers(kinds.tool_calls(after))
    out: list[dict[str, Any]] = []
    for item in kept if isinstance(kept, list) else []:
        tool = answers.take(item.get("tool_call_id")) if _is_result(item) else None
        if "content" in item:
            out.append(dict(item))
        else:
            content = tool_result_content(tool.result, tool.error) if tool else None
            out.append({**item, "content": content})
    for tool in answers.rest():
        head = {"tool_call_id": tool.call_id} if tool.call_id else {"name": tool.tool}
        out.append({"role": "tool", **head,
                    "content": tool_result_content(tool.result, tool.error)})
    return out


def _is_result(message: dict[str, Any]) -> bool:
    """A tool message naming the call it answers."""
    return message.get("role") == "tool" and isinstance(message.get("tool_call_id"), str)


def _kept(call: kinds.ModelCall) -> dict[str, Any]:
    kept = call.extra.get("openai")
    return kept if isinstance(kept, dict) else {}

