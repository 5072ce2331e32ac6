"""One Claude Code transcript's lines turned into records (claude_code.py has the mapping).

`TranscriptBuilder` reads a transcript in file order: the assistant lines of
one API response (one content block a line, sometimes each line repeating
the blocks before it) merge into one model call, whose conversation is the
`parentUuid` chain before its first line; the tool results of a user line
become tool_call steps after the call that asked; every other line is kept
with the step it precedes. Each line is kept, its content left to the step
(`_hollow`), so that export writes it back. `TranscriptIndex` is what a
subagent's run needs of the transcript that started it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.formats.jsonl import JsonLines, Line
from kvtrace.formats.records import (
    UNKNOWN_MODEL,
    ModelCallRecord,
    Record,
    ToolCallRecord,
    check_storable,
    keep,
)
from kvtrace.store import ProviderApi

KEY = "claude_code"  # the key of meta.extra this format keeps its lines under
SYNTHETIC_MODEL = "<synthetic>"  # what Claude Code writes as the model of its own messages


@dataclass
class _Call:
    """An API response being assembled from its lines."""

    first: Line
    lines: list[Line] = field(default_factory=list)
    blocks: list[dict[str, Any]] = field(default_factory=list)
    kept: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Tool:
    """A tool_result block and the tool_use it answers."""

    line: Line
    block: dict[str, Any]
    use: dict[str, Any]
    kept: dict[str, Any] = field(default_factory=dict)


@dataclass
class TranscriptIndex:
    """What linking a subagent needs from a built transcript."""

    tool_records: dict[str, int]  # tool_use_id -> record index of its tool_call
    call_records: dict[str, int]  # tool_use_id -> record index of the model call that asked
    agents: dict[str, str]  # agentId -> tool_use_id whose toolUseResult names it
    task_prompts: dict[str, str]  # prompt text -> tool_use_id of the Task that was given it
    first_prompt: str | None  # the first user text of this transcript

    def started(self, agent_id: str, prompt: str | None) -> tuple[int | None, str | None]:
        """(record index, tool_use_id) of the step that started subagent `agent_id`."""
        use = self.agents.get(agent_id) or (self.task_prompts.get(prompt) if prompt else None)
        if use is None:
            return None, None
        if use in self.tool_records:
            return self.tool_records[use], use
        return self.call_records.get(use), use


class TranscriptBuilder:
    """One transcript's lines in file order, turned into records (see the module docstring)."""

    def __init__(self, lines: JsonLines) -> None:
        for line in lines:
            check_storable(line.value, lines.where(line))
        self.lines = lines
        self.by_uuid = _by_uuid(lines)
        self.calls: dict[str, _Call] = {}  # by response id
        self.call_of_line: dict[int, _Call] = {}  # by line number
        self.uses: dict[str, tuple[dict[str, Any], _Call]] = {}  # tool_use id -> block, call

    def build(self) -> tuple[list[Record], TranscriptIndex]:
        items: list[_Call | _Tool] = []
        pending: list[Any] = []  # lines no step carries yet: kept with the next step
        for line in self.lines:
            kind = _kind(line, self.lines)
            if kind == "assistant":
                call = self._add_response_line(line)
                if call.first is line:
                    call.kept["before"], pending = pending, []
                    items.append(call)
            elif kind == "results":
                tools = self._tools(line)
                tools[0].kept["before"], pending = pending, []
                tools[0].kept["line"] = _hollow(line.value)
                tools[0].kept["content"] = [
                    {"tool_result": keep(block, {"content"})}
                    if isinstance(block, dict) and block.get("type") == "tool_result"
                    else {"block": block} for block in line.value["message"]["content"]]
                for joined in tools[1:]:  # written with the first result of their line
                    joined.kept["joined"] = True
                items.extend(tools)
            else:
                pending.append(line.value)
        if not any(isinstance(item, _Call) for item in items):
            raise UsageError(f"{self.lines.source} has no assistant message with a model's "
                             "answer: there is no model call to import")
        if pending:
            items[-1].kept["after"] = pending
        return self._records(items)

    def _add_response_line(self, line: Line) -> _Call:
        message = line.value["message"]
        key = message.get("id") if isinstance(message.get("id"), str) else line.value.get("uuid")
        call = self.calls.setdefault(str(key) if key else f"line {line.number}", _Call(line))
        blocks = [dict(b) for b in message["content"]]
        is_cumulative = bool(call.blocks) and blocks[: len(call.blocks)] == call.blocks
        new = blocks[len(call.blocks):] if is_cumulative else blocks
        entry: dict[str, Any] = {"line": _hollow(line.value), "blocks": len(new)}
        if any(value is None for block in new for value in block.values()):
            entry["shapes"] = [keep(block, set(block)) for block in new]  # nulls, key order
        if is_cumulative:
            entry["cumulative"] = True
        call.kept.setdefault("lines", []).append(entry)
        call.lines.append(line)
        self.call_of_line[line.number] = call
        call.blocks.extend(new)
        for block in new:
            if block.get("type") == "tool_use" and isinstance(block.get("id"), str):
                self.uses[block["id"]] = (block, call)
        return call

    def _tools(self, line: Line) -> list[_Tool]:
        tools = []
        for position, block in enumerate(line.value["message"]["content"]):
            if not isinstance(block, dict) or block.get("type") != "tool_result":
                continue
            use_id = block.get("tool_use_id")
            if not isinstance(use_id, str) or use_id not in self.uses:
                raise UsageError(f"{self.lines.where(line)}: content[{position}] is a "
                                 f"tool_result for {use_id!r}, which answers no tool_use of an "
                                 "earlier assistant line")
            tools.append(_Tool(line, block, self.uses[use_id][0]))
        return tools

    def _records(self, items: list[_Call | _Tool]) -> tuple[list[Record], TranscriptIndex]:
        records: list[Record] = []
        index = TranscriptIndex({}, {}, {}, {}, None)
        for item in items:
            if isinstance(item, _Call):
                records.append(self._model_call(item))
                for block in item.blocks:
                    if block.get("type") == "tool_use" and isinstance(block.get("id"), str):
                        index.call_records[block["id"]] = len(records) - 1
                        prompt = (block.get("input") or {}).get("prompt")
                        if isinstance(prompt, str):
                            index.task_prompts.setdefault(prompt, block["id"])
            else:
                use_id = item.block["tool_use_id"]
                index.tool_records.setdefault(use_id, len(records))
                result = item.line.value.get("toolUseResult")
                if isinstance(result, dict) and isinstance(result.get("agentId"), str):
                    index.agents.setdefault(result["agentId"], use_id)
                records.append(ToolCallRecord(
                    str(item.use.get("name") or "unknown"), item.use.get("input", {}),
                    item.block.get("content", ""), call_id=use_id,
                    extra={KEY: item.kept} if item.kept else {}))
        index.first_prompt = self._first_prompt()
        return records, index

    def _model_call(self, call: _Call) -> ModelCallRecord:
        last = call.lines[-1].value["message"]
        first = call.first.value["message"]
        stop = next((line.value["message"]["stop_reason"] for line in reversed(call.lines)
                     if isinstance(line.value["message"].get("stop_reason"), str)), None)
        response: dict[str, Any] = {"role": "assistant", "content": call.blocks}
        if stop is not None:
            response["stop_reason"] = stop
        model = first.get("model")
        usage = last.get("usage")
        record = ModelCallRecord(
            self._conversation(call.first), response,
            model if isinstance(model, str) and model else UNKNOWN_MODEL,
            usage=dict(usage) if isinstance(usage, Mapping) else None,
            extra={KEY: call.kept}, api=ProviderApi.ANTHROPIC_MESSAGES)
        record.check(self.lines.where(call.first))
        return record

    def _conversation(self, first: Line) -> list[dict[str, Any]]:
        """The Messages-API conversation of the chain before `first` (module docstring)."""
        chain: list[Line] = []
        uuid = first.value.get("parentUuid")
        while isinstance(uuid, str) and uuid in self.by_uuid and len(chain) <= len(self.lines):
            line = self.by_uuid[uuid]
            chain.append(line)
            uuid = line.value.get("parentUuid")
        messages: list[dict[str, Any]] = []
        placed: set[int] = set()
        for line in reversed(chain):
            kind = _kind(line, self.lines)
            if kind == "assistant":
                call = self.call_of_line[line.number]
                if id(call) not in placed:
                    placed.add(id(call))
                    messages.append({"role": "assistant", "content": list(call.blocks)})
            elif kind in ("user", "results"):
                content = line.value["message"]["content"]
                if messages and messages[-1]["role"] == "user":
                    messages[-1]["content"] = [*_blocks(messages[-1]["content"]),
                                               *_blocks(content)]
                else:
                    messages.append({"role": "user", "content": content})
        return messages

    def _first_prompt(self) -> str | None:
        for line in self.lines:
            if _kind(line, self.lines) == "user":
                content = line.value["message"]["content"]
                texts = [content] if isinstance(content, str) else [
                    b.get("text") for b in content if isinstance(b, dict)
                    and b.get("type") == "text"]
                return next((t for t in texts if isinstance(t, str)), None)
        return None


def _by_uuid(lines: JsonLines) -> dict[str, Line]:
    """Each line by its uuid. A uuid names one line (the same line written twice is that
    line): a `parentUuid` naming two lines that differ has no one conversation, and the
    one taken would depend on the lines' order, which export does not keep."""
    found: dict[str, Line] = {}
    for line in lines:
        uuid = line.value.get("uuid")
        if not isinstance(uuid, str):
            continue
        other = found.setdefault(uuid, line)
        if other.value != line.value:
            raise UsageError(f"{lines.where(line)}: uuid {uuid!r} is also the uuid of line "
                             f"{other.number}, a different line: each line has its own uuid")
    return found


def _kind(line: Line, lines: JsonLines) -> str:
    """assistant (a model's answer), results (tool results), user (a prompt) or other."""
    value = line.value
    kind = value.get("type")
    if kind not in ("user", "assistant") or "message" not in value:
        return "other"
    message = value["message"]
    where = lines.where(line)
    if not isinstance(message, dict):
        raise UsageError(f"{where}: message must be an object (role and content)")
    content = message.get("content")
    if kind == "assistant":
        if message.get("model") == SYNTHETIC_MODEL or value.get("isApiErrorMessage") is True:
            return "other"
        if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            raise UsageError(f"{where}: an assistant message's content must be a list of "
                             "content blocks")
        return "assistant"
    if not isinstance(content, (str, list)):
        raise UsageError(f"{where}: a user message's content must be a string or a list of "
                         "content blocks")
    if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in content):
        return "results"
    return "user"


def _hollow(line: Mapping[str, Any]) -> dict[str, Any]:
    """The line with its message's content left to the steps (`null` in its place)."""
    return {**line, "message": {**line["message"], "content": None}}


def _blocks(content: Any) -> list[Any]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
