"""Claude Code session transcripts in: one JSONL file a session, one a subagent, as runs.

Claude Code writes `~/.claude/projects/<project>/<sessionId>.jsonl`, one
event a line, and each subagent's sidechain in a file of its own
(`<sessionId>/subagents/agent-<agentId>.jsonl` since 2.1, earlier
`agent-<agentId>.jsonl` beside the session). `user` and `assistant` lines
carry a Messages-API `message`; `uuid` / `parentUuid` chain the lines.
Import (docs/formats.md has the table):

- an API response is every assistant line with its `message.id` (Claude
  Code writes one content block a line): one model_call, spoken in
  `anthropic-messages`, whose messages are the conversation of the
  `parentUuid` chain before its first line (the lines of one response one
  assistant message, consecutive user lines one user message), whose
  response is the merged blocks (thinking, text, tool_use) with the last
  `stop_reason`, `model` its `message.model` and `usage` its last line's
  usage as sent (`cache_read_input_tokens`, `cache_creation_input_tokens`);
- each `tool_result` block answering a `tool_use` of an earlier assistant
  line is a tool_call step after the call that asked (call_id, the
  tool_use's name and input, result the block's `content`; `is_error` and
  `toolUseResult` stay in the kept line); a `tool_result` answering none is
  an error naming its line, and nothing is imported;
- summary, progress, file-history-snapshot, system, queue-operation lines
  and synthetic assistant messages (`<synthetic>`, API errors) are no model
  call: kept, in order, with the step they precede;
- the transcript holds neither system prompt nor tool definitions, so the
  calls have none (the provider's prompt counts include them: analyze sets
  rates, not token counts, side by side);
- a subagent is its own run, `RUN/agent-<agentId>`, whose first model call
  links to the step that started it: `meta.extra.claude_code.parent` =
  `{"step": <id>, "tool_use_id": ...}`, the tool_call step whose
  `toolUseResult.agentId` names it (else the model call that asked for the
  Task whose prompt it was given). A meta link, not a note: it is part of
  the step, so an export and an import give it back.

Every line is kept in `meta.extra.claude_code` of the step it belongs to
(content left to the step, `null` in its place), so export
(claude_code_export.py) writes the file back from the run's steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.formats.jsonl import JsonLines, Line, parse_jsonl
from kvtrace.formats.records import (
    UNKNOWN_MODEL,
    ModelCall,
    Record,
    ToolCall,
    check_storable,
    keep,
    record_into,
    run_info,
)
from kvtrace.store import OnStep, ProviderApi, RunInfo, Store, validate_run_name

KEY = "claude_code"  # the key of meta.extra this format keeps its lines under
SYNTHETIC_MODEL = "<synthetic>"  # what Claude Code writes as the model of its own messages


@dataclass(frozen=True, slots=True)
class Session:
    """A session's transcript and the transcripts of its subagents (sidechains)."""

    transcript: JsonLines
    subagents: tuple[JsonLines, ...] = ()


@dataclass(frozen=True, slots=True)
class Subagent:
    """A subagent's steps and the main run's record that started it (its index)."""

    agent_id: str
    records: list[Record]
    parent: int | None
    tool_use_id: str | None


@dataclass(frozen=True, slots=True)
class Plan:
    """What a session becomes: the main run's records and one run per subagent."""

    records: list[Record]
    subagents: list[Subagent]


def subagent_run(run: str, agent_id: str) -> str:
    """The run a subagent of run `run` is imported into."""
    return validate_run_name(f"{run}/agent-{agent_id}")


def import_claude_code(store: Store, document: Any, *, run: str,
                       on_step: OnStep | None = None) -> RunInfo:
    """Record a session (`Session`, `JsonLines` or a list of line objects) as run `run`.

    Its subagents become runs `run/agent-<id>`; all runs are written in one
    transaction, after every line was checked.
    """
    plan = claude_code_plan(document)
    names = [subagent_run(validate_run_name(run), agent.agent_id) for agent in plan.subagents]
    with store.batch():
        steps = record_into(store, run, plan.records, on_step=on_step)
        for agent, name in zip(plan.subagents, names, strict=True):
            records = list(agent.records)
            if agent.parent is not None and records and isinstance(records[0], ModelCall):
                first = records[0]
                link = {"step": steps[agent.parent], "tool_use_id": agent.tool_use_id}
                kept = {**first.extra.get(KEY, {}), "parent": link}
                records[0] = replace(first, extra={**first.extra, KEY: kept})
            record_into(store, name, records)
    return run_info(store, run)


def read_session(data: bytes, filename: str | None) -> Session:
    """A session file's bytes, with its subagents' files found beside it on disk."""
    transcript = parse_jsonl(data, filename or "the session")
    return Session(transcript, tuple(
        parse_jsonl(path.read_bytes(), str(path)) for path in _subagent_files(filename,
                                                                              transcript)))


def claude_code_plan(document: Any) -> Plan:
    """The records of a session and of its subagents, every line checked (nothing written)."""
    session = _session(document)
    main, sidechains = _split(session.transcript)
    records, index = _Builder(main).build()
    subagents = [_subagent(lines, index) for lines in [*sidechains, *session.subagents]]
    seen = set()
    for agent in subagents:
        if agent.agent_id in seen:
            raise UsageError(f"two sidechains of subagent {agent.agent_id!r}: import one of them")
        seen.add(agent.agent_id)
    return Plan(records, subagents)


def claude_code_records(document: Any) -> list[Record]:
    """The main run's records of a session (its subagents' in `claude_code_plan`)."""
    return claude_code_plan(document).records


# -- reading ------------------------------------------------------------------------------


def _session(document: Any) -> Session:
    if isinstance(document, Session):
        return document
    if isinstance(document, JsonLines):
        return Session(document)
    if isinstance(document, list):
        return Session(JsonLines.of(document, "the transcript"))
    raise UsageError("a Claude Code session is its transcript's lines (JSONL: one JSON object "
                     "a line)")


def _subagent_files(filename: str | None, transcript: JsonLines) -> list[Path]:
    """The sidechain files of the session at `filename`: the 2.1 layout, then the older one."""
    if filename is None:
        return []
    path = Path(filename)
    found = sorted((path.parent / path.stem / "subagents").glob("agent-*.jsonl"))
    session_ids = {line.value.get("sessionId") for line in transcript} - {None}
    for other in sorted(path.parent.glob("agent-*.jsonl")):
        if other.resolve() != path.resolve() and _first_session_id(other) in session_ids:
            found.append(other)
    return found


def _first_session_id(path: Path) -> Any:
    with path.open("rb") as file:
        first = file.readline()
    try:
        return parse_jsonl(first, path.name).lines[0].value.get("sessionId")
    except UsageError:
        return None  # a bad first line is reported when the file is read whole


def _split(transcript: JsonLines) -> tuple[JsonLines, list[JsonLines]]:
    """The main thread's lines, and sidechains kept in the same file (Claude Code before 1.0).

    A file of sidechain lines only (a subagent's own file, imported alone) is its own main.
    """
    sidechain = [line.value.get("isSidechain") is True for line in transcript
                 if line.value.get("type") in ("user", "assistant")]
    if not any(sidechain) or all(sidechain):
        return transcript, []
    main = [line for line in transcript if line.value.get("isSidechain") is not True]
    chains: dict[str, list[Line]] = {}
    for line in transcript:
        if line.value.get("isSidechain") is True:
            agent = line.value.get("agentId")
            chains.setdefault(agent if isinstance(agent, str) else "sidechain", []).append(line)
    return (JsonLines(transcript.source, tuple(main)),
            [JsonLines(transcript.source, tuple(lines)) for lines in chains.values()])


def _subagent(lines: JsonLines, main: _Index) -> Subagent:
    agent_id = next((line.value["agentId"] for line in lines
                     if isinstance(line.value.get("agentId"), str) and line.value["agentId"]),
                    None)
    if agent_id is None:
        stem = Path(lines.source).name.rsplit(".", 1)[0]
        agent_id = stem.removeprefix("agent-") if stem.startswith("agent-") else "sidechain"
    records, index = _Builder(lines).build()
    parent, tool_use_id = main.started(agent_id, index.first_prompt)
    return Subagent(agent_id, records, parent, tool_use_id)


# -- building ----------------------------------------------------------------------------


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
class _Index:
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


class _Builder:
    """One transcript's lines in file order, turned into records (see the module docstring)."""

    def __init__(self, lines: JsonLines) -> None:
        for line in lines:
            check_storable(line.value, lines.where(line))
        self.lines = lines
        self.by_uuid = {line.value["uuid"]: line for line in lines
                        if isinstance(line.value.get("uuid"), str)}
        self.calls: dict[str, _Call] = {}  # by response id
        self.call_of_line: dict[int, _Call] = {}  # by line number
        self.uses: dict[str, tuple[dict[str, Any], _Call]] = {}  # tool_use id -> block, call

    def build(self) -> tuple[list[Record], _Index]:
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

    def _records(self, items: list[_Call | _Tool]) -> tuple[list[Record], _Index]:
        records: list[Record] = []
        index = _Index({}, {}, {}, {}, None)
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
                records.append(ToolCall(
                    str(item.use.get("name") or "unknown"), item.use.get("input", {}),
                    item.block.get("content", ""), call_id=use_id,
                    extra={KEY: item.kept} if item.kept else {}))
        index.first_prompt = self._first_prompt()
        return records, index

    def _model_call(self, call: _Call) -> ModelCall:
        last = call.lines[-1].value["message"]
        first = call.first.value["message"]
        stop = next((line.value["message"]["stop_reason"] for line in reversed(call.lines)
                     if isinstance(line.value["message"].get("stop_reason"), str)), None)
        response: dict[str, Any] = {"role": "assistant", "content": call.blocks}
        if stop is not None:
            response["stop_reason"] = stop
        model = first.get("model")
        usage = last.get("usage")
        record = ModelCall(
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
