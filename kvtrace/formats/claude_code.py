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
(claude_code_export.py) writes the file back from the run's steps. This
module finds a session's files and plans its runs; claude_code_transcript.py
turns one transcript's lines into records.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.formats.claude_code_transcript import KEY, TranscriptBuilder, TranscriptIndex
from kvtrace.formats.claude_code_transcript import SYNTHETIC_MODEL as SYNTHETIC_MODEL
from kvtrace.formats.jsonl import JsonLines, Line, parse_jsonl
from kvtrace.formats.records import ModelCallRecord, Record, record_into, run_info
from kvtrace.store import OnStep, RunInfo, Store, validate_run_name


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
            if agent.parent is not None and records and isinstance(records[0], ModelCallRecord):
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
    records, index = TranscriptBuilder(main).build()
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


def _subagent(lines: JsonLines, main: TranscriptIndex) -> Subagent:
    agent_id = next((line.value["agentId"] for line in lines
                     if isinstance(line.value.get("agentId"), str) and line.value["agentId"]),
                    None)
    if agent_id is None:
        stem = Path(lines.source).name.rsplit(".", 1)[0]
        agent_id = stem.removeprefix("agent-") if stem.startswith("agent-") else "sidechain"
    records, index = TranscriptBuilder(lines).build()
    parent, tool_use_id = main.started(agent_id, index.first_prompt)
    return Subagent(agent_id, records, parent, tool_use_id)
