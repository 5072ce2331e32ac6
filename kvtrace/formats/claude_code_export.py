"""Claude Code transcripts out: a run's steps as the session file they came from, or would.

The inverse of claude_code.py. Steps are walked in order; a step that
kept its lines (`meta.extra.claude_code`: an imported step, not an edited
copy) writes them back, its content taken from the step: an assistant
line's blocks from the model call's response, a tool result from its
tool_call step. A step without kept lines (recorded by kvtrace, continued,
or an edited copy in a fork) is written as Claude Code would have written
it: the new user turns of its prompt as `user` lines, its response as one
`assistant` line (thinking, text, tool_use blocks; a chat-shaped call's
reasoning, text and tool calls converted), a tool_call step as a `user`
line with one `tool_result`; each such line gets a uuid derived from its
step and chains (`parentUuid`) to the line before it, and its `sessionId`,
`cwd` and the like from the last kept line. A subagent's run exports to
its own file (its kept lines say `isSidechain` and `agentId`).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
from typing import Any

from kvtrace.apis import anthropic
from kvtrace.errors import UsageError
from kvtrace.formats.claude_code import KEY
from kvtrace.formats.records import kept_lines, restore
from kvtrace.rendering import tool_result_content
from kvtrace.store import OnStep, ProviderApi, Step, Store, kinds

# Fields a generated line takes from the last line that was kept (or sensible defaults).
_SHARED = ("isSidechain", "userType", "cwd", "sessionId", "version", "gitBranch", "agentId",
           "slug")


def export_claude_code(store: Store, spec: str, *,
                       on_step: OnStep | None = None) -> list[dict[str, Any]]:
    """The run up to `spec` as Claude Code transcript lines (see the module docstring)."""
    path = list(store.walk(spec, on_step=on_step))
    if not any(step.kind == kinds.StepKind.MODEL_CALL for step in path):
        raise UsageError(f"{spec} has no model call: there is no conversation to export")
    writer = _Writer(path)
    for index, step in enumerate(path):
        if step.kind == kinds.StepKind.MODEL_CALL:
            writer.model_call(kinds.ModelCall(step))
        elif step.kind == kinds.StepKind.TOOL_CALL:
            writer.tool_call(kinds.ToolCall(step), kinds.tool_calls(path[index + 1:]))
    last = next((s for s in reversed(path) if s.kind in (kinds.StepKind.MODEL_CALL,
                                                           kinds.StepKind.TOOL_CALL)), None)
    if last is not None:
        writer.out.extend(copy.deepcopy(_kept(last).get("after", [])))
    return writer.out


class _Writer:
    """The lines written so far, and what the next generated line continues from."""

    def __init__(self, path: list[Step]) -> None:
        self.out: list[dict[str, Any]] = []
        self.parent: str | None = None  # uuid of the last user or assistant line
        self.shared: dict[str, Any] = {"isSidechain": False, "userType": "external",
                                       "sessionId": _uuid(path[0].id, "session")}
        self.taken: set[str] = set()  # tool steps written with an earlier step's line
        self.previous: kinds.ModelCall | None = None

    # -- model calls --

    def model_call(self, call: kinds.ModelCall) -> None:
        kept = _kept(call.step)
        if kept.get("lines"):
            self._lines(kept.get("before", []))
            blocks = _response_blocks(call)
            start = 0
            for entry in kept["lines"]:
                line = copy.deepcopy(entry["line"])
                count = int(entry.get("blocks", 0))
                own = [restore(block, shape) for block, shape in zip(
                    blocks[start: start + count], entry.get("shapes") or [None] * count,
                    strict=False)]
                line["message"]["content"] = [*blocks[:start], *own] if entry.get(
                    "cumulative") else own
                start += count
                self._line(line)
            if start < len(blocks):  # blocks no kept line carries: on the last one
                self.out[-1]["message"]["content"].extend(blocks[start:])
        else:
            for message in self._new_user_messages(call):
                self._generated(call.step, "user", {"role": "user",
                                                    "content": _user_content(message)})
            response = call.response if isinstance(call.response, dict) else {}
            native = call.native.get("response") if call.api is (
                ProviderApi.ANTHROPIC_MESSAGES) else None
            message = {
                "model": call.model or "unknown", "id": f"msg_{call.step.id[:24]}",
                "type": "message", "role": "assistant", "content": _response_blocks(call),
                "stop_reason": (native or {}).get("stop_reason") or _stop_reason(response),
                "stop_sequence": None, "usage": call.raw_usage or None,
            }
            self._generated(call.step, "assistant", message)
        self.previous = call

    def _new_user_messages(self, call: kinds.ModelCall) -> list[dict[str, Any]]:
        """The user turns this call's prompt adds to the previous call's context."""
        messages = call.messages
        start = 0
        if self.previous is not None:
            before = [*self.previous.messages, self.previous.response]
            if messages[: len(before)] == before:
                start = len(before)
        return [m for m in messages[start:] if m.get("role") == "user"]

    # -- tool calls --

    def tool_call(self, tool: kinds.ToolCall, later: list[kinds.ToolCall]) -> None:
        if tool.step.id in self.taken:
            return
        kept = _kept(tool.step)
        if kept.get("line"):
            self._lines(kept.get("before", []))
            line = copy.deepcopy(kept["line"])
            queue = [tool, *later]
            content = []
            for part in kept.get("content", []):
                if "tool_result" not in part:
                    content.append(copy.deepcopy(part.get("block")))
                    continue
                wanted = part["tool_result"].get("fields", {}).get("tool_use_id")
                answer = next((t for t in queue if t.step.id not in self.taken
                               and (wanted is None or t.call_id == wanted)), None)
                if answer is not None:
                    self.taken.add(answer.step.id)
                mapped = {"tool_use_id": answer.call_id if answer else wanted,
                          "content": _result(answer) if answer else None}
                content.append(restore(mapped, part["tool_result"]))
            line["message"]["content"] = content
            self._line(line)
            return
        if tool.call_id is None:
            return  # a tool result must name the tool_use it answers: no line can say it
        block: dict[str, Any] = {"tool_use_id": tool.call_id, "type": "tool_result",
                                 "content": _result(tool)}
        self._generated(tool.step, "user", {"role": "user", "content": [block]})

    # -- lines --

    def _lines(self, lines: list[Any]) -> None:
        for line in lines:
            self._line(copy.deepcopy(line))

    def _line(self, line: dict[str, Any]) -> None:
        self.out.append(line)
        if line.get("type") in ("user", "assistant") and isinstance(line.get("uuid"), str):
            self.parent = line["uuid"]
            self.shared.update({k: line[k] for k in _SHARED if k in line})

    def _generated(self, step: Step, kind: str, message: dict[str, Any]) -> None:
        uuid = _uuid(step.id, f"{kind}{len(self.out)}")
        line = {"parentUuid": self.parent, **self.shared, "type": kind, "message": message,
                "uuid": uuid, "timestamp": _timestamp(step.recorded_at)}
        self._line(line)


def _kept(step: Step) -> dict[str, Any]:
    return kept_lines(step, KEY)


def _response_blocks(call: kinds.ModelCall) -> list[dict[str, Any]]:
    """The response as Anthropic content blocks (a chat-shaped response converted)."""
    if call.api is ProviderApi.ANTHROPIC_MESSAGES:
        native = call.native.get("response")
        if isinstance(native, dict) and isinstance(native.get("content"), list):
            return [dict(b) for b in native["content"]]
    response: dict[str, Any] = call.response if isinstance(call.response, dict) else {
        "content": str(call.response)}
    return anthropic.blocks_of({**response, "role": "assistant"})


def _text_blocks(content: Any) -> list[dict[str, Any]]:
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [dict(part) for part in content if isinstance(part, dict)]


def _user_content(message: dict[str, Any]) -> Any:
    content = message.get("content")
    return content if isinstance(content, str) else _text_blocks(content)


def _stop_reason(response: dict[str, Any]) -> str:
    return "tool_use" if response.get("tool_calls") else "end_turn"


def _result(tool: kinds.ToolCall) -> Any:
    """A tool step's result as a tool_result's content (an error as its text)."""
    content = tool_result_content(tool.result, tool.error)
    if content is None or isinstance(content, str) or (
            isinstance(content, list) and all(isinstance(p, dict) for p in content)):
        return content
    return json.dumps(content, ensure_ascii=False, sort_keys=True)


def _uuid(step_id: str, salt: str) -> str:
    """A uuid-shaped id derived from a step (the same export gives the same ids)."""
    digest = hashlib.sha256(f"kvtrace/claude-code\0{step_id}\0{salt}".encode()).hexdigest()
    return f"{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def _timestamp(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
