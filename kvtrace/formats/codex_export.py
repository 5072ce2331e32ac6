"""Codex rollouts out: a run's steps as the rollout file they came from, or would.

The inverse of codex.py. A step that kept its lines (`meta.extra.codex`:
an imported step, not an edited copy) writes them back in order, each item
taken from the step (a model call's output items from its response, a
tool output from the tool_call step answering that call). A step without
kept lines is written as Codex would have: a `session_meta` line first
when the run starts with one (its `instructions` as `base_instructions`),
a `turn_context` where the model changes, the new user turns of its input
and its output items as `response_item` lines (a chat-shaped call's
reasoning, text and tool calls converted), then an `event_msg`
`token_count` with its usage; a tool_call step as a `function_call_output`
(`custom_tool_call_output` for a custom tool's call).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
from typing import Any

from kvtrace.apis import responses
from kvtrace.errors import UsageError
from kvtrace.formats.codex import KEY, is_model_item
from kvtrace.formats.records import kept_lines, restore
from kvtrace.rendering import content_text, tool_result_content
from kvtrace.store import OnStep, ProviderApi, Step, Store, kinds


def export_codex(store: Store, spec: str, *,
                 on_step: OnStep | None = None) -> list[dict[str, Any]]:
    """The run up to `spec` as Codex rollout lines (see the module docstring)."""
    path = list(store.walk(spec, on_step=on_step))
    if not any(step.kind == kinds.StepKind.MODEL_CALL for step in path):
        raise UsageError(f"{spec} has no model call: there is no conversation to export")
    writer = _Writer()
    for index, step in enumerate(path):
        if step.kind == kinds.StepKind.MODEL_CALL:
            writer.model_call(kinds.ModelCall(step), kinds.tool_calls(path[index + 1:]))
        elif step.kind == kinds.StepKind.TOOL_CALL:
            writer.tool_call(kinds.ToolCall(step))
    last = next((s for s in reversed(path) if s.kind in (kinds.StepKind.MODEL_CALL,
                                                           kinds.StepKind.TOOL_CALL)), None)
    if last is not None:
        writer.out.extend(copy.deepcopy(_kept(last).get("after", [])))
    return writer.out


class _Writer:
    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.taken: set[str] = set()  # tool steps written with their model call's lines
        self.previous: kinds.ModelCall | None = None
        self.model: str | None = None  # of the last turn_context written or kept
        self.custom: set[str] = set()  # call ids of custom tool calls

    def model_call(self, call: kinds.ModelCall, later: list[kinds.ToolCall]) -> None:
        output = _output_items(call)
        self.custom.update(i["call_id"] for i in output if i.get("type") == "custom_tool_call")
        kept = _kept(call.step)
        if kept.get("lines"):
            for entry in kept["lines"]:
                self._entry(entry, output, later)
        else:
            self._generated(call, output)
        self.previous = call

    def _entry(self, entry: dict[str, Any], output: list[dict[str, Any]],
               later: list[kinds.ToolCall]) -> None:
        line = copy.deepcopy(entry.get("line"))
        if not isinstance(line, dict):
            return
        if "output" in entry:
            position = int(entry["output"])
            if position >= len(output):
                return
            line["payload"] = restore(output[position], entry.get("shape"))
        elif "result" in entry:
            tool = next((t for t in later if t.step.id not in self.taken
                         and t.call_id == entry["result"]), None)
            if tool is None:
                return  # the run was cut (or forked) before this result
            self.taken.add(tool.step.id)
            line["payload"] = restore({"output": _output_text(tool)}, entry.get("shape"))
        self._line(line)

    def _generated(self, call: kinds.ModelCall, output: list[dict[str, Any]]) -> None:
        step = call.step
        if not self.out:
            meta: dict[str, Any] = {"id": _uuid(step.id), "timestamp": _time(step),
                                    "originator": "kvtrace"}
            instructions = call.native.get("instructions")
            if isinstance(instructions, str):
                meta["base_instructions"] = {"text": instructions}
            self._line({"timestamp": _time(step), "type": "session_meta", "payload": meta})
        if call.model and call.model != self.model:
            self._line({"timestamp": _time(step), "type": "turn_context",
                        "payload": {"model": call.model}})
        for item in [*self._new_inputs(call), *output]:
            self._line({"timestamp": _time(step), "type": "response_item", "payload": item})
        if call.raw_usage:
            self._line({"timestamp": _time(step), "type": "event_msg", "payload": {
                "type": "token_count", "info": {"last_token_usage": call.raw_usage}}})

    def _new_inputs(self, call: kinds.ModelCall) -> list[dict[str, Any]]:
        """The input items this call adds to the previous call's (its tool outputs aside)."""
        if call.api is ProviderApi.OPENAI_RESPONSES:
            items = list(call.native.get("input") or [])
            start = 0
            if self.previous is not None and self.previous.api is ProviderApi.OPENAI_RESPONSES:
                before = [*(self.previous.native.get("input") or []),
                          *_output_items(self.previous)]
                if items[: len(before)] == before:
                    start = len(before)
            return [i for i in items[start:] if not is_model_item(i)
                    and i.get("type") not in ("function_call_output", "custom_tool_call_output")]
        messages = call.messages
        start = 0
        if self.previous is not None:
            before = [*self.previous.messages, self.previous.response]
            if messages[: len(before)] == before:
                start = len(before)
        return [{"type": "message", "role": m["role"], "content": [
            {"type": "input_text", "text": content_text(m.get("content"))}]}
            for m in messages[start:] if m.get("role") in ("user", "developer", "system")]

    def tool_call(self, tool: kinds.ToolCall) -> None:
        if tool.step.id in self.taken or tool.call_id is None:
            return
        kept = _kept(tool.step)
        if kept.get("joined"):
            return  # its model call was cut from the export: no line carries it
        if kept.get("lines"):
            for entry in kept["lines"]:
                if "result" in entry:
                    self.taken.add(tool.step.id)
                    line = copy.deepcopy(entry["line"])
                    line["payload"] = restore({"output": _output_text(tool)}, entry.get("shape"))
                    self._line(line)
                else:
                    self._line(copy.deepcopy(entry["line"]))
            return
        kind = ("custom_tool_call_output" if tool.call_id in self.custom
                else "function_call_output")
        self._line({"timestamp": _time(tool.step), "type": "response_item", "payload": {
            "type": kind, "call_id": tool.call_id, "output": _output_text(tool)}})

    def _line(self, line: dict[str, Any]) -> None:
        self.out.append(line)
        payload = line.get("payload")
        if line.get("type") == "turn_context" and isinstance(payload, dict):
            self.model = payload.get("model") if isinstance(payload.get("model"), str) else None


def _kept(step: Step) -> dict[str, Any]:
    return kept_lines(step, KEY)


def _output_items(call: kinds.ModelCall) -> list[dict[str, Any]]:
    """The response as Responses output items (a chat-shaped response converted)."""
    if call.api is ProviderApi.OPENAI_RESPONSES:
        native = call.native.get("response")
        if isinstance(native, dict) and isinstance(native.get("output"), list):
            return [dict(i) for i in native["output"]]
    response: dict[str, Any] = call.response if isinstance(call.response, dict) else {
        "content": str(call.response)}
    return responses.items_of({**response, "role": "assistant"})


def _output_text(tool: kinds.ToolCall) -> Any:
    """A tool step's result as an output item's `output` (text, or a list of parts)."""
    content = tool_result_content(tool.result, tool.error)
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return content
    return "" if content is None else content if isinstance(content, str) else str(content)


def _uuid(step_id: str) -> str:
    digest = hashlib.sha256(f"kvtrace/codex\0{step_id}".encode()).hexdigest()
    return f"{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def _time(step: Step) -> str:
    moment = datetime.datetime.fromtimestamp(step.recorded_at, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
