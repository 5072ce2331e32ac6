"""One line that describes a step, as `kvtrace log`, `diff` and the HTML report show it.

Long values are cut to a few dozen characters and whitespace runs become
one space, so a summary always fits on one line; the full content is what
`Store.show` returns.
"""

from __future__ import annotations

import json
from typing import Any

from kvtrace.store.kinds import ModelCall, StepKind, ToolCall, VerdictStep, is_cut
from kvtrace.store.records import Step


def snippet(value: Any, width: int = 60) -> str:
    """`value` (text, or any JSON value) on one line, cut to `width` characters."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def step_summary(step: Step) -> str:
    """What a step did, in one line: model and response, tool and result, or its content;
    `[incomplete]` first where the answer was cut before its end (kinds.is_cut)."""
    line = _summary(step)
    return f"[incomplete] {line}" if is_cut(step) else line


def _summary(step: Step) -> str:
    if step.kind == StepKind.MODEL_CALL:
        call = ModelCall(step)
        response = call.response
        if isinstance(response, dict):
            calls = [
                f"{c['function'].get('name')}({c['function'].get('arguments', '')})"
                for c in response.get("tool_calls") or [] if isinstance(c.get("function"), dict)
            ]
            text = response.get("content")
            response = " ".join([*([snippet(text, 40)] if text else []),
                                 *(f"-> {call}" for call in calls)]) or response
        return f"{call.model or '?'}: {snippet(response)}"
    if step.kind == StepKind.TOOL_CALL:
        tool = ToolCall(step)
        error = f" error={tool.error}" if tool.error else ""
        args = snippet(tool.arguments, 30)
        return f"{tool.tool}({args}) -> {snippet(tool.result, 40)}{error}"
    if step.kind == StepKind.VERDICT:
        verdict = VerdictStep(step)
        outcome = ("passed" if verdict.passed else "timed out" if verdict.timed_out
                   else f"FAILED (exit code {verdict.exit_code})")
        return f"{outcome} in {verdict.seconds:.1f} s: {snippet(verdict.command, 60)}"
    return snippet({k: v for k, v in step.content.items() if not isinstance(v, bytes)})
