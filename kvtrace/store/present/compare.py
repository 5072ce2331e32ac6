"""What differs between two runs: the first pair of steps whose content differs, field by field.

`compare(store, a, b)` starts from `Store.diverge` (the last common step, as
`git merge-base`) and walks both paths from there, position by position:

- runs that share history (a run and its fork) are compared from the first
  step after the common one;
- unrelated runs (no common step) are aligned from the root, step i of one
  against step i of the other.

A pair whose ids differ but whose content is equal (only the timings, usage
or recorded time differ) is skipped; the first pair whose content differs is
described field by field, each field as both texts and a unified diff
(difflib): a model call's differing prompt messages (matched with
difflib.SequenceMatcher, so an inserted message shows as one insertion), its
response text and each tool call with its arguments, its tools and sampling
parameters, a tool call's name, arguments, result and error. Arguments that
are JSON are pretty-printed first, so that a changed value is one changed
line. Returns records; the CLI prints them.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

from kvtrace.apis.chat import tool_calls_of
from kvtrace.rendering import content_text
from kvtrace.store.kinds import ModelCall, StepKind, ToolCall
from kvtrace.store.records import Divergence, Step
from kvtrace.store.store import Store

MAX_DIFF_LINES = 400  # per field; both full texts stay in the record


@dataclass(frozen=True, slots=True)
class FieldDiff:
    """One field that differs: its text on each side (None: absent there) and a unified diff."""

    field: str
    a: str | None
    b: str | None
    diff: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "a": self.a, "b": self.b, "diff": self.diff}


@dataclass(frozen=True, slots=True)
class Comparison:
    """Where two runs part and what differs at the first step whose content differs.

    `step_a`/`step_b` are that pair (one is None when a run ends first; both
    when the runs have the same content throughout); `position` is their
    1-based position on the runs (RUN@N). `num_same_content` counts the
    aligned pairs before it with different ids but equal content.
    """

    a: str
    b: str
    divergence: Divergence
    step_a: Step | None
    step_b: Step | None
    position: int | None
    num_same_content: int
    changes: list[FieldDiff]

    @property
    def is_related(self) -> bool:
        """Whether the runs share history (a common step), as a run and its fork do."""
        return self.divergence.common is not None

    @property
    def is_same_content(self) -> bool:
        """Whether every aligned step has the same content and neither run has more steps."""
        return self.step_a is None and self.step_b is None

    def to_dict(self) -> dict[str, Any]:
        def view(step: Step | None) -> dict[str, Any] | None:
            return step.to_dict() if step else None

        return {
            "a": self.a,
            "b": self.b,
            **self.divergence.to_dict(),
            "related": self.is_related,
            "first_difference": {
                "position": self.position,
                "a": view(self.step_a),
                "b": view(self.step_b),
                "num_same_content": self.num_same_content,
                "changes": [change.to_dict() for change in self.changes],
            },
        }


def compare(store: Store, a: str, b: str) -> Comparison:
    """The divergence of runs (or steps) `a` and `b` and the first step whose content differs."""
    divergence = store.diverge(a, b)
    path_a, path_b = store.path(a), store.path(b)
    start = divergence.common.depth if divergence.common else 0
    num_same = 0
    for index in range(start, max(len(path_a), len(path_b))):
        step_a = path_a[index] if index < len(path_a) else None
        step_b = path_b[index] if index < len(path_b) else None
        if step_a is None or step_b is None:
            return Comparison(a, b, divergence, step_a, step_b, index + 1, num_same, [])
        changes = step_changes(step_a, step_b, a, b)
        if changes:
            return Comparison(a, b, divergence, step_a, step_b, index + 1, num_same, changes)
        num_same += step_a.id != step_b.id
    return Comparison(a, b, divergence, None, None, None, num_same, [])


def step_changes(
    step_a: Step, step_b: Step, label_a: str = "a", label_b: str = "b"
) -> list[FieldDiff]:
    """The fields whose content differs between two steps ([] when only ids or timings do)."""
    fields = _Fields(label_a, label_b)
    if step_a.kind != step_b.kind:
        fields.add("kind", step_a.kind, step_b.kind)
        fields.add("content", _pretty(step_a.content), _pretty(step_b.content))
    elif step_a.kind == StepKind.MODEL_CALL:
        _model_call(fields, ModelCall(step_a), ModelCall(step_b))
    elif step_a.kind == StepKind.TOOL_CALL:
        tool_a, tool_b = ToolCall(step_a), ToolCall(step_b)
        fields.add("tool", tool_a.tool, tool_b.tool)
        fields.add("call_id", tool_a.call_id, tool_b.call_id)
        fields.add("arguments", _pretty(tool_a.arguments), _pretty(tool_b.arguments))
        fields.add("result", _pretty(tool_a.result), _pretty(tool_b.result))
        fields.add("error", tool_a.error, tool_b.error)
    else:
        for key in sorted(set(step_a.content) | set(step_b.content)):
            fields.add(key, _pretty(step_a.content.get(key)), _pretty(step_b.content.get(key)))
    return fields.changes


class _Fields:
    """Collects FieldDiffs, keeping only the fields whose texts differ."""

    def __init__(self, label_a: str, label_b: str) -> None:
        self.labels = (label_a, label_b)
        self.changes: list[FieldDiff] = []

    def add(self, field: str, a: str | None, b: str | None) -> None:
        if a == b:
            return
        lines = list(difflib.unified_diff(
            (a or "").splitlines(), (b or "").splitlines(),
            fromfile=f"{self.labels[0]} {field}", tofile=f"{self.labels[1]} {field}",
            lineterm="", n=3,
        ))
        if len(lines) > MAX_DIFF_LINES:
            cut = len(lines) - MAX_DIFF_LINES
            lines = [*lines[:MAX_DIFF_LINES], f"… {cut} more diff lines (see the full texts)"]
        self.changes.append(FieldDiff(field, a, b, lines))


def _model_call(fields: _Fields, call_a: ModelCall, call_b: ModelCall) -> None:
    fields.add("model", call_a.model, call_b.model)
    # The name asked for, where another model answered (kvtrace serve answers any name with
    # its own model): a fork whose agent asked for another model parts here.
    fields.add("request model", call_a.request_model, call_b.request_model)
    messages_a, messages_b = call_a.messages, call_b.messages
    keys_a = [json.dumps(m, sort_keys=True) for m in messages_a]
    keys_b = [json.dumps(m, sort_keys=True) for m in messages_b]
    matcher = difflib.SequenceMatcher(a=keys_a, b=keys_b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        for i, j in zip_longest(range(i1, i2), range(j1, j2)):
            old = messages_a[i] if i is not None else None
            new = messages_b[j] if j is not None else None
            shown = new if new is not None else old
            role = shown.get("role", "?") if isinstance(shown, dict) else "?"
            where = j if j is not None else i
            fields.add(f"messages[{where}] ({role})", _message_text(old), _message_text(new))
    response_a, response_b = call_a.response, call_b.response
    for key in ("content", "reasoning_content"):
        fields.add(f"response.{key}", _part(response_a, key), _part(response_b, key))
    calls_a, calls_b = tool_calls_of(response_a), tool_calls_of(response_b)
    for index, (old, new) in enumerate(zip_longest(calls_a, calls_b)):
        fields.add(f"response.tool_calls[{index}]", _call_text(old), _call_text(new))
    fields.add("tools", _pretty(call_a.tools), _pretty(call_b.tools))
    fields.add("params", _pretty(call_a.params or None), _pretty(call_b.params or None))


def _part(message: Any, key: str) -> str | None:
    if isinstance(message, str):
        return message if key == "content" else None
    if not isinstance(message, dict) or message.get(key) is None:
        return None
    return content_text(message[key])


def _message_text(message: Any) -> str | None:
    """A chat message as text: its content, then its tool calls (arguments pretty-printed)."""
    if message is None:
        return None
    if not isinstance(message, dict):
        return _pretty(message)
    lines = []
    if message.get("tool_call_id") is not None:
        lines.append(f"[answers tool call {message['tool_call_id']}]")
    if message.get("name") is not None:
        lines.append(f"[name {message['name']}]")
    if message.get("reasoning_content"):
        lines.append(f"[reasoning] {message['reasoning_content']}")
    content = message.get("content")
    lines.append(content_text(content) if isinstance(content, (str, list)) or content is None
                 else _pretty(content) or "")
    lines.extend(_call_text(call) or "" for call in tool_calls_of(message))
    return "\n".join(lines)


def _call_text(call: Any) -> str | None:
    """One tool call: `call NAME (id ID)` and its arguments, pretty-printed when JSON."""
    if call is None:
        return None
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return _pretty(call)
    head = f"call {function.get('name')}" + (f" (id {call['id']})" if call.get("id") else "")
    return f"{head}\n{_pretty(function.get('arguments'))}"


def _pretty(value: Any) -> str | None:
    """Text to diff: strings as they are (JSON strings pretty-printed), other values as JSON."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] in ("{", "["):
            try:
                value = json.loads(stripped)
            except ValueError:
                return value
        else:
            return value
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=_raw)


def _raw(value: Any) -> str:
    """Raw bytes inside a JSON value (an http step's bodies), as text."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)
