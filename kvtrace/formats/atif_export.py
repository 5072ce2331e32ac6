"""An ATIF trajectory out: the run's steps as the document atif.py imports.

Each model call is an agent step (its message, reasoning, tool calls and
metrics), preceded by the system and user steps its prompt adds to the
previous call's, and followed by its observation: the tool results of the
next prompt, else (after the last call) the run's tool steps. What import
kept in `meta.extra.atif` (ids, timestamps, `extra`, notes, ...) is put back
around the mapped fields, so a run imported from ATIF exports an equivalent
document; a run recorded otherwise exports a new one, agent `kvtrace`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from kvtrace.apis.chat import normalize_response, tool_calls_of
from kvtrace.errors import UsageError
from kvtrace.formats.atif import LATEST_VERSION, USAGE_FIELDS
from kvtrace.formats.records import Answers, arguments_value, restore
from kvtrace.rendering import tool_result_content
from kvtrace.store import OnStep, Store, kinds
from kvtrace.store.objects.lists import shared_prefix


def export_atif(store: Store, spec: str, *,
                on_step: OnStep | None = None) -> dict[str, Any]:
    """The run up to `spec` as an ATIF trajectory (the one it was imported from, if it was)."""
    path = list(store.walk(spec, on_step=on_step))
    model_steps = kinds.model_calls(path)
    if not model_steps:
        raise UsageError(f"{spec} has no model call: there is no trajectory to export")
    out: list[tuple[dict[str, Any], Any]] = []  # (mapped, kept) per ATIF step, in order
    agent: dict[str, Any] | None = None
    agent_kept: dict[str, Any] = {}
    context: list[dict[str, Any]] = []
    results: list[kinds.ToolCall] = []
    for step in path:
        if step.kind == kinds.StepKind.TOOL_CALL:
            results.append(kinds.ToolCall(step))
        if step.kind != kinds.StepKind.MODEL_CALL:
            continue
        call = kinds.ModelCall(step)
        kept = _kept(call)
        messages = call.messages
        response = normalize_response(call.response)
        new = messages[shared_prefix(context, messages):]
        if agent is not None:
            size = _observation_size(agent_kept, new)
            _observe(agent, agent_kept, new[:size], results, is_last=False)
            new = new[size:]
        before = kept.get("before")
        if not isinstance(before, list) or len(before) != len(new):
            before = [None] * len(new)
        out.extend((_message_step(m), k) for m, k in zip(new, before, strict=True))
        agent = _agent_step(call, response, kept)
        agent_kept = kept
        out.append((agent, kept.get("step")))
        context, results = [*messages, response], []
    if agent is not None:
        _observe(agent, agent_kept, [], results, is_last=True)
    steps: list[Any] = []
    for position, (mapped, kept_step) in enumerate(out, start=1):
        steps.append(restore({"step_id": position, **mapped}, kept_step))
    after = agent_kept.get("after")
    if isinstance(after, list):
        steps.extend(after)
    first = model_steps[0]
    mapped_root = {
        "schema_version": LATEST_VERSION,
        "session_id": path[-1].id,
        "agent": restore({"name": "kvtrace", "version": _version(),
                          "model_name": first.model,
                          "tool_definitions": first.tools}, None),
        "steps": steps,
    }
    return restore(mapped_root, _kept(first).get("root"))


def _kept(call: kinds.ModelCall) -> dict[str, Any]:
    kept = call.extra.get("atif")
    return kept if isinstance(kept, dict) else {}


def _observation_size(kept: Mapping[str, Any], new: list[dict[str, Any]]) -> int:
    """How many of a prompt's new messages are the previous agent step's observation."""
    observation = kept.get("observation")
    if isinstance(observation, dict) and isinstance(observation.get("results"), list):
        return min(len(observation["results"]), len(new))
    size = 0
    while size < len(new) and new[size].get("role") == "tool":
        size += 1
    return size


def _observe(
    agent: dict[str, Any], kept: Mapping[str, Any], messages: list[dict[str, Any]],
    results: list[kinds.ToolCall], *, is_last: bool,
) -> None:
    """Give an exported agent step its observation, from later prompt messages and tool steps.

    The results are the prompt messages that follow the step's response (tool
    results and terminal output), else, after the last model call, the tool
    steps and what was kept whole; tool steps no message shows come last. A
    message or step takes the tool steps answering its call in order (a call
    may be answered twice). A result names its call (`source_call_id`) only
    when the step made that call: ATIF has no tool result of another step's
    call (a trimmed conversation), so such a result is plain output.
    """
    observation = kept.get("observation")
    observation = observation if isinstance(observation, dict) else {}
    kept_results = observation.get("results")
    kept_results = kept_results if isinstance(kept_results, list) else []
    made = {call.get("tool_call_id") for call in agent.get("tool_calls") or []}

    def mapped(call_id: str | None, content: Any) -> dict[str, Any]:
        return {"source_call_id": call_id if call_id in made else None, "content": content}

    answers = Answers(results)
    pairs: list[tuple[dict[str, Any], Any]] = []  # (mapped, kept) per result
    if messages:
        aligned = kept_results if len(kept_results) == len(messages) else [None] * len(messages)
        for message, kept_result in zip(messages, aligned, strict=True):
            call_id = message.get("tool_call_id") if message.get("role") == "tool" else None
            tool = answers.take(call_id) if call_id else None
            content = _result_content(tool) if tool else message.get("content")
            pairs.append((mapped(call_id, content), kept_result))
    elif is_last:
        for kept_result in kept_results:
            if kept_result.get("whole"):
                pairs.append(({}, kept_result))
            elif tool := answers.take():  # else the run stops before this result (a fork, say)
                pairs.append((mapped(tool.call_id, _result_content(tool)), kept_result))
    for tool in answers.rest():
        pairs.append((mapped(tool.call_id, _result_content(tool)), None))
    if not pairs and not observation:
        return
    agent["observation"] = restore(
        {"results": [restore(mapped, kept_result) for mapped, kept_result in pairs]},
        observation.get("kept"),
    )


def _result_content(tool: kinds.ToolCall) -> Any:
    return tool_result_content(tool.result, tool.error)


def _message_step(message: dict[str, Any]) -> dict[str, Any]:
    """A system or user step from a prompt message (an assistant message: an agent step)."""
    roles = {"system": "system", "developer": "system", "assistant": "agent"}
    source = roles.get(str(message.get("role")), "user")
    content = message.get("content")
    return {"source": source, "message": "" if content is None else content}


def _agent_step(model_call: kinds.ModelCall, response: dict[str, Any],
                kept: Mapping[str, Any]) -> dict[str, Any]:
    """An agent step from a model call (its observation is added once the next prompt is seen)."""
    kept_calls = kept.get("tool_calls")
    kept_calls = kept_calls if isinstance(kept_calls, list) else []
    calls = []
    for index, call in enumerate(tool_calls_of(response)):
        function = call.get("function", {})
        arguments = arguments_value(function.get("arguments", "{}") or "{}")
        mapped = {"tool_call_id": call.get("id"), "function_name": function.get("name"),
                  "arguments": arguments if isinstance(arguments, dict) else {"input": arguments}}
        calls.append(restore(mapped, kept_calls[index] if index < len(kept_calls) else None))
    content = response.get("content")
    return {
        "timestamp": None if kept.get("step") else _timestamp(model_call.step.recorded_at),
        "source": "agent",
        "model_name": model_call.model,
        "message": "" if content is None else content,
        "reasoning_content": response.get("reasoning_content"),
        "tool_calls": calls or None,
        "metrics": restore(_metrics(model_call), kept.get("metrics")) or None,
    }


def _metrics(call: kinds.ModelCall) -> dict[str, Any]:
    """ATIF metrics from a recorded usage; keys ATIF has no field for go under `extra`.

    The counts ATIF names are the normalised ones (any provider's usage), so
    an Anthropic call's cache reads become `cached_tokens` too.
    """
    usage, counts = call.raw_usage, call.usage
    metrics = {key: usage[key] for key in USAGE_FIELDS if key in usage}
    for key, value in (("prompt_tokens", counts.prompt_tokens),
                       ("completion_tokens", counts.completion_tokens),
                       ("cached_tokens", counts.cached_tokens)):
        if value is not None:
            metrics.setdefault(key, value)
    rest = {k: v for k, v in usage.items() if k not in USAGE_FIELDS}
    if rest:
        metrics["extra"] = rest
    return metrics


def _timestamp(recorded_at: float) -> str:
    moment = datetime.datetime.fromtimestamp(recorded_at, tz=datetime.UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def _version() -> str:
    try:
        return metadata.version("kvtrace")
    except metadata.PackageNotFoundError:
        return "unknown"
