"""Codex rollouts in: one session's JSONL file (`rollout-<time>-<id>.jsonl`) as a run.

Codex writes `~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl`, one
`{"timestamp", "type", "payload"}` a line: `session_meta` first (its
`base_instructions.text` is the request's `instructions`), `turn_context`
at each turn (`model`, `effort`...), `response_item` for every item of the
conversation as the Responses API has it, `event_msg` for what the UI
showed (`token_count` after each model response: `info.last_token_usage`
is that request's usage, `cached_input_tokens` inside `input_tokens`),
`compacted` where the history was compacted. Import (docs/formats.md):

- a model call is the run of items the model produced (reasoning,
  assistant message, function_call, custom_tool_call, local_shell_call,
  web_search_call...), spoken in `openai-responses`: its input the items
  recorded before it, its response those items. It ends at the next
  `token_count` with usage (whose `last_token_usage` is its `usage`; or the
  difference of `total_token_usage`), at a user message, or when a model
  item follows the output of one of its own calls (the model answered that
  output in a new request). Its model is the last `turn_context`'s.
- a `function_call_output` / `custom_tool_call_output` answering a call is a
  tool_call step after the model call (call_id, the call's name and
  arguments, result its `output`); one answering no call is an error
  naming the line, and nothing is imported.
- `compacted` replaces the history the next calls send with its
  `replacement_history` (without one, Codex's older form, with the user
  messages so far and the summary as a user message).
- the other lines (events, turn contexts, `session_meta`) are kept.

Every line is kept in `meta.extra.codex` of the step it belongs to, items
left to the steps (`null` in their place), so export (codex_export.py)
writes the rollout back from the run's steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.formats.jsonl import JsonLines, Line
from kvtrace.formats.records import (
    UNKNOWN_MODEL,
    ModelCallRecord,
    Record,
    ToolCallRecord,
    arguments_value,
    check_storable,
    keep,
    record,
)
from kvtrace.store import OnStep, ProviderApi, RunInfo, Store

KEY = "codex"  # the key of meta.extra this format keeps its lines under
MODEL_ITEMS = frozenset({"reasoning", "function_call", "custom_tool_call", "local_shell_call",
                         "web_search_call", "image_generation_call", "tool_search_call"})
CALLS = frozenset({"function_call", "custom_tool_call", "local_shell_call"})
OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})


def import_codex(store: Store, document: Any, *, run: str,
                 on_step: OnStep | None = None) -> RunInfo:
    """Record a rollout (`JsonLines` or a list of line objects) as the new run `run`."""
    return record(store, run, codex_records(document), on_step=on_step)


def codex_records(document: Any) -> list[Record]:
    """The steps a rollout becomes, every line checked first (see the module docstring)."""
    if isinstance(document, list):
        document = JsonLines.of(document, "the rollout")
    if not isinstance(document, JsonLines):
        raise UsageError("a Codex rollout is its lines (JSONL: one JSON object a line)")
    for line in document:
        check_storable(line.value, document.where(line))
    return _Builder(document).build()


def is_model_item(item: dict[str, Any]) -> bool:
    """Whether a response item is one the model produced (not an input the harness sent)."""
    kind = item.get("type")
    return kind in MODEL_ITEMS or (kind == "message" and item.get("role") == "assistant")


@dataclass
class _Call:
    input: list[dict[str, Any]]
    instructions: str | None
    model: str
    first: Line
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    kept: list[dict[str, Any]] = field(default_factory=list)  # its lines, in order
    tools: list[ToolCallRecord] = field(default_factory=list)  # answered while it was open
    is_answered: bool = False  # an output of one of its calls came in


class _Builder:
    def __init__(self, lines: JsonLines) -> None:
        self.lines = lines
        self.history: list[dict[str, Any]] = []
        self.calls: dict[str, dict[str, Any]] = {}  # call_id -> the call item
        self.instructions: str | None = None
        self.model = UNKNOWN_MODEL
        self.total: dict[str, Any] | None = None  # the last total_token_usage
        self.open: _Call | None = None
        self.records: list[Record] = []
        self.pending: list[dict[str, Any]] = []  # kept entries no step carries yet

    def build(self) -> list[Record]:
        for line in self.lines:
            kind, payload = line.value.get("type"), line.value.get("payload")
            if kind == "response_item":
                if not isinstance(payload, dict) or not isinstance(payload.get("type"), str):
                    raise UsageError(f"{self.lines.where(line)}: a response_item's payload "
                                     "must be a Responses item (an object with a type)")
                self._item(line, payload)
            elif kind == "event_msg" and isinstance(payload, dict) and (
                    payload.get("type") == "token_count"):
                self._token_count(line, payload)
            else:
                self._context(line, kind, payload)
        self._close()
        if not any(isinstance(r, ModelCallRecord) for r in self.records):
            raise UsageError(f"{self.lines.source} has no item a model produced: there is no "
                             "model call to import")
        if self.pending:
            last = self.records[-1]
            last.extra.setdefault(KEY, {})["after"] = [entry["line"] for entry in self.pending]
        return self.records

    # -- lines --

    def _item(self, line: Line, item: dict[str, Any]) -> None:
        if is_model_item(item):
            if self.open is not None and self.open.is_answered:
                self._close()
            if self.open is None:
                self.open = _Call(list(self.history), self.instructions, self.model, line)
                self.open.kept, self.pending = self.pending, []
            self.open.kept.append({"line": _hollow(line.value), "output": len(self.open.output),
                                   "shape": keep(item, set(item))})
            self.open.output.append(item)
            if item["type"] in CALLS:
                call_id = item.get("call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise UsageError(f"{self.lines.where(line)}: a {item['type']} item needs "
                                     "a call_id")
                self.calls[call_id] = item
            self.history.append(item)
            return
        if item["type"] == "message" and item.get("role") == "user":
            self._close()  # a new user turn: the model's answer is over
        if item["type"] in OUTPUTS:
            self._output(line, item)
        else:
            self._keep(line.value)
        self.history.append(item)

    def _output(self, line: Line, item: dict[str, Any]) -> None:
        call_id = item.get("call_id")
        call = self.calls.get(call_id) if isinstance(call_id, str) else None
        if call is None:
            raise UsageError(f"{self.lines.where(line)}: {item['type']} for {call_id!r} "
                             "answers no call an earlier line made")
        arguments: Any = call.get("arguments") if call["type"] == "function_call" else (
            call.get("input") if call["type"] == "custom_tool_call" else call.get("action"))
        if call["type"] == "function_call":
            arguments = arguments_value(arguments)
        entry = {"line": _hollow(line.value), "result": call_id,
                 "shape": keep(item, {"output"})}
        output = item.get("output")
        tool = ToolCallRecord(str(call.get("name") or call["type"]), arguments,
                              output if output is not None else "", call_id=call_id)
        if self.open is not None and call in self.open.output:
            self.open.is_answered = True
            self.open.kept.append(entry)
            tool.extra[KEY] = {"joined": True}  # written with its model call's lines
            self.open.tools.append(tool)
        else:
            self._close()
            tool.extra[KEY] = {"lines": [*self.pending, entry]}
            self.pending = []
            self.records.append(tool)

    def _token_count(self, line: Line, payload: dict[str, Any]) -> None:
        info = payload.get("info")
        usage = None
        if isinstance(info, dict):
            last, total = info.get("last_token_usage"), info.get("total_token_usage")
            if isinstance(last, dict):
                usage = dict(last)
            elif isinstance(total, dict):
                usage = _difference(total, self.total)
            if isinstance(total, dict):
                self.total = total
        if self.open is not None and usage is not None and self.open.usage is None:
            self.open.usage = usage
            self.open.kept.append({"line": line.value})
            self._close()
            return
        self._keep(line.value)

    def _context(self, line: Line, kind: Any, payload: Any) -> None:
        if kind == "session_meta" and isinstance(payload, dict):
            base = payload.get("base_instructions")
            if isinstance(base, dict) and isinstance(base.get("text"), str):
                self.instructions = base["text"] or None
        elif kind == "turn_context" and isinstance(payload, dict):
            if isinstance(payload.get("model"), str) and payload["model"]:
                self.model = payload["model"]
        elif kind == "compacted" and isinstance(payload, dict):
            self._close()
            self.history = self._compacted(line, payload)
        self._keep(line.value)

    def _compacted(self, line: Line, payload: dict[str, Any]) -> list[dict[str, Any]]:
        replacement = payload.get("replacement_history")
        if isinstance(replacement, list):
            if not all(isinstance(i, dict) and isinstance(i.get("type"), str)
                       for i in replacement):
                raise UsageError(f"{self.lines.where(line)}: replacement_history must be a "
                                 "list of Responses items")
            return [dict(i) for i in replacement]
        kept = [i for i in self.history if i.get("type") == "message"
                and i.get("role") in ("user", "developer")]
        summary = payload.get("message")
        if isinstance(summary, str) and summary:
            kept.append({"type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": summary}]})
        return kept

    def _keep(self, value: dict[str, Any]) -> None:
        """Keep a line with the open call (between its items), else for the next step."""
        (self.open.kept if self.open is not None else self.pending).append({"line": value})

    # -- steps --

    def _close(self) -> None:
        call, self.open = self.open, None
        if call is None:
            return
        record_ = ModelCallRecord(call.input, {"output": call.output}, call.model, usage=call.usage,
                                  extra={KEY: {"lines": call.kept}},
                                  api=ProviderApi.OPENAI_RESPONSES, system=call.instructions)
        record_.check(self.lines.where(call.first))
        self.records.append(record_)
        self.records.extend(call.tools)


def _hollow(line: dict[str, Any]) -> dict[str, Any]:
    """The line with its item left to the steps (`null` in its place)."""
    return {**line, "payload": None}


def _difference(total: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """One request's usage from two running totals (older rollouts have only the totals)."""
    out = {}
    for key, value in total.items():
        earlier = (before or {}).get(key, 0)
        if isinstance(value, int) and isinstance(earlier, int):
            out[key] = value - earlier
    return out
