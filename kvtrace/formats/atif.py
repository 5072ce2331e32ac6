"""Harbor's Agent Trajectory Interchange Format (ATIF), versions 1.0 to 1.7.

An ATIF trajectory is an object with `schema_version` ("ATIF-v1.N"), `agent`
and `steps` (each from `system`, `user` or `agent`). Import walks the steps
and builds the conversation the agent saw:

- a system or user step is a message (its `message`, a string or content
  parts) in the prompts of the agent steps after it;
- an agent step is a model_call: messages = the conversation so far,
  response = an assistant message with the step's `message`,
  `reasoning_content` and `tool_calls` (arguments as JSON text), model = the
  step's `model_name` or the agent's, tools = `agent.tool_definitions`,
  usage = the `metrics` kvtrace knows (`prompt_tokens`, `completion_tokens`,
  `cached_tokens`, `cost_usd`, `completion_token_ids`);
- each observation result with a `source_call_id` is a tool_call step
  (`call_id`, name and arguments of the step's matching tool call) and a
  `role: "tool"` message in later prompts; a result without one (terminal
  output) is a user message in later prompts.

Everything else (ids, timestamps, `extra` at every level, notes,
final_metrics, logprobs, ...) is kept in the model call's
`meta.extra.atif`, so that export rebuilds an equivalent document from the
run's steps (atif_export.py); see docs/formats.md for where each field
goes. A major version
other than 1 is refused; later 1.x minors only add optional fields, which
are kept like any other.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvtrace.apis.chat import normalize_message, tool_calls_of
from kvtrace.errors import UsageError
from kvtrace.formats.records import (
    UNKNOWN_MODEL,
    ModelCallRecord,
    Record,
    ToolCallRecord,
    arguments_value,
    check_storable,
    keep,
    record,
    tools,
)
from kvtrace.store import OnStep, RunInfo, Store

LATEST_VERSION = "ATIF-v1.7"
_VERSION = re.compile(r"ATIF-v(\d+)\.(\d+)")
SOURCES = ("system", "user", "agent")
ROOT_MAPPED = frozenset({"steps"})
MESSAGE_STEP_MAPPED = frozenset({"source", "message"})
AGENT_STEP_MAPPED = frozenset(
    {"source", "message", "model_name", "reasoning_content", "tool_calls", "observation", "metrics"}
)
CALL_MAPPED = frozenset({"tool_call_id", "function_name", "arguments"})
RESULT_MAPPED = frozenset({"source_call_id", "content"})
_MISSING: Any = object()  # a required field that is absent (null is a value)
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "cost_usd",
                "completion_token_ids")


def import_atif(store: Store, document: Any, *, run: str,
                on_step: OnStep | None = None) -> RunInfo:
    """Record an ATIF trajectory as the new run `run`."""
    return record(store, run, atif_records(document), on_step=on_step)


def atif_records(document: Any) -> list[Record]:
    """The steps a trajectory becomes, every element checked first (see the module docstring)."""
    check_storable(document)
    if not isinstance(document, dict):
        raise UsageError("an ATIF document is a JSON object with schema_version, agent and steps")
    _check_version(document.get("schema_version"))
    agent = document.get("agent")
    if not isinstance(agent, dict):
        raise UsageError("agent: missing (an object with the agent's name and version)")
    default_model = agent.get("model_name")
    if default_model is not None and not isinstance(default_model, str):
        raise UsageError("agent.model_name must be a string")
    tool_list = tools(agent.get("tool_definitions"), "agent.tool_definitions")
    steps = document.get("steps")
    if not isinstance(steps, list):
        raise UsageError("steps: missing (a list of steps)")
    for index, step in enumerate(steps):
        where = f"steps[{index}]"
        if not isinstance(step, dict):
            raise UsageError(f"{where} must be an object")
        if step.get("source") not in SOURCES:
            raise UsageError(f"{where}.source is {step.get('source')!r}: use system, user or agent")
        _check_content(step.get("message", _MISSING), f"{where}.message")
    agents = [i for i, step in enumerate(steps) if step["source"] == "agent"]
    if not agents:
        raise UsageError("steps: no agent step, so there is no model call to import")

    records: list[Record] = []
    conversation: list[dict[str, Any]] = []
    before: list[dict[str, Any]] = []  # kept system/user steps since the last agent step
    sent = 0  # the messages the previous model call sent
    for index, step in enumerate(steps[: agents[-1] + 1]):
        where = f"steps[{index}]"
        if step["source"] != "agent":
            message = {"role": step["source"], "content": step["message"]}
            conversation.append(normalize_message(message, where))
            before.append(keep(step, MESSAGE_STEP_MAPPED))
            continue
        response, kept_calls = _response(step, where)
        model = step.get("model_name") or default_model or UNKNOWN_MODEL
        if not isinstance(model, str):
            raise UsageError(f"{where}.model_name must be a string")
        usage, kept_metrics = _usage(step.get("metrics"), where)
        kept: dict[str, Any] = {"step": keep(step, AGENT_STEP_MAPPED), "before": before}
        if kept_calls:
            kept["tool_calls"] = kept_calls
        if kept_metrics is not None:
            kept["metrics"] = kept_metrics
        results, observed, kept_observation = _observation(
            step, response, where, is_last=index == agents[-1]
        )
        if kept_observation is not None:
            kept["observation"] = kept_observation
        if index == agents[0]:
            kept["root"] = keep(document, ROOT_MAPPED)
        if index == agents[-1] and index + 1 < len(steps):  # in no prompt: kept whole
            kept["after"] = steps[index + 1 :]
        # Each call continues the previous one's messages: records hold each message once.
        records.append(ModelCallRecord(conversation[sent:], response, model, tool_list, usage,
                                       {"atif": kept}, continues=bool(records)))
        sent = len(conversation)
        records.extend(results)
        conversation.append(response)
        conversation.extend(observed)
        before = []
    return records


def _check_version(version: Any) -> None:
    if version is None:
        raise UsageError('schema_version: missing (an ATIF document says e.g. "ATIF-v1.7")')
    match = _VERSION.fullmatch(version) if isinstance(version, str) else None
    if match is None:
        raise UsageError(f'schema_version is {version!r}: expected "ATIF-v1.N"')
    if int(match.group(1)) != 1:
        raise UsageError(
            f"schema_version is {version!r}: kvtrace reads ATIF-v1.0 to {LATEST_VERSION} "
            "(major version 1)"
        )


def _check_content(content: Any, where: str, *, can_be_null: bool = False) -> None:
    """A message or result content: a string or a list of content parts (ATIF 1.6)."""
    if content is _MISSING:
        raise UsageError(f"{where}: missing")
    if isinstance(content, str) or (content is None and can_be_null):
        return
    if not isinstance(content, list):
        raise UsageError(f"{where} must be a string or a list of content parts")
    for index, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise UsageError(f"{where}[{index}] must be a content part with a type")


def _response(step: dict[str, Any], where: str) -> tuple[dict[str, Any], list[Any]]:
    """The assistant message of an agent step, and what is kept of each of its tool calls."""
    response: dict[str, Any] = {"role": "assistant", "content": step["message"]}
    reasoning = step.get("reasoning_content")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise UsageError(f"{where}.reasoning_content must be a string")
        response["reasoning_content"] = reasoning
    calls = step.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise UsageError(f"{where}.tool_calls must be a list")
    openai_calls, kept_calls, seen = [], [], set()
    for index, call in enumerate(calls or []):
        at = f"{where}.tool_calls[{index}]"
        if not isinstance(call, dict):
            raise UsageError(f"{at} must be an object")
        for key in ("tool_call_id", "function_name"):
            if not isinstance(call.get(key), str) or not call[key]:
                raise UsageError(f"{at}: missing {key}")
        if call["tool_call_id"] in seen:
            raise UsageError(f"{at}: tool_call_id {call['tool_call_id']!r} is used twice")
        seen.add(call["tool_call_id"])
        arguments = call.get("arguments", _MISSING)
        if arguments is _MISSING:
            raise UsageError(f"{at}: missing arguments")
        if arguments is not None and not isinstance(arguments, dict):
            raise UsageError(f"{at}.arguments must be an object")
        openai_calls.append({
            "id": call["tool_call_id"], "type": "function",
            "function": {"name": call["function_name"],
                         "arguments": json.dumps(arguments or {}, ensure_ascii=False)},
        })
        kept_calls.append(keep(call, CALL_MAPPED))
    if openai_calls:
        response["tool_calls"] = openai_calls
    return normalize_message(response, where), kept_calls


def _usage(metrics: Any, where: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The usage kvtrace records from an agent step's metrics, and what is kept of the rest."""
    if metrics is None:
        return None, None
    if not isinstance(metrics, dict):
        raise UsageError(f"{where}.metrics must be an object")
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        value = metrics.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise UsageError(f"{where}.metrics.{key} must be a whole number")
    cost = metrics.get("cost_usd")
    if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float))):
        raise UsageError(f"{where}.metrics.cost_usd must be a number")
    ids = metrics.get("completion_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise UsageError(f"{where}.metrics.completion_token_ids must be a list of token ids")
    usage = {key: metrics[key] for key in USAGE_FIELDS if metrics.get(key) is not None}
    return usage or None, keep(metrics, frozenset(USAGE_FIELDS))


def _observation(
    step: dict[str, Any], response: dict[str, Any], where: str, *, is_last: bool
) -> tuple[list[Record], list[dict[str, Any]], dict[str, Any] | None]:
    """An agent step's observation: tool_call records, the messages later prompts see, kept."""
    observation = step.get("observation")
    if observation is None:
        return [], [], None
    if not isinstance(observation, dict) or not isinstance(observation.get("results"), list):
        raise UsageError(f"{where}.observation must be an object with a list of results")
    calls = {call["id"]: call for call in tool_calls_of(response)}
    records: list[Record] = []
    messages: list[dict[str, Any]] = []
    kept_results: list[dict[str, Any]] = []
    for index, result in enumerate(observation["results"]):
        at = f"{where}.observation.results[{index}]"
        if not isinstance(result, dict):
            raise UsageError(f"{at} must be an object")
        content = result.get("content")
        _check_content(content, f"{at}.content", can_be_null=True)
        call_id = result.get("source_call_id")
        if call_id is None:
            if is_last:  # no later prompt carries it: kept whole
                kept_results.append({**keep(result, frozenset()), "whole": True})
                continue
            messages.append(normalize_message({"role": "user", "content": content}, at))
        else:
            call = calls.get(call_id) if isinstance(call_id, str) else None
            if call is None:
                raise UsageError(
                    f"{at}: source_call_id {call_id!r} matches no tool call of this step")
            function = call["function"]
            records.append(ToolCallRecord(function["name"], arguments_value(function["arguments"]),
                                          content, call_id=call_id))
            messages.append(normalize_message(
                {"role": "tool", "tool_call_id": call_id, "content": content}, at))
        kept_results.append(keep(result, RESULT_MAPPED))
    kept = {"kept": keep(observation, frozenset({"results"})), "results": kept_results}
    return records, messages, kept
