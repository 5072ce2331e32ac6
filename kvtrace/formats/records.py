"""What an imported document becomes: the records of a run, checked before anything is written.

A format module converts a whole document into a list of `ModelCallRecord` and
`ToolCallRecord` records first, validating every element (a bad file is a
UsageError naming the first offending element), and only then `record`s
them, into a run that is new or empty. So a bad file writes nothing.

Fields of a format that kvtrace does not model travel in each record's
`extra` as *kept* objects (`keep`/`restore`): the object's keys in their
order, and the values kvtrace does not map, so that an export rebuilds the
original object from the run's steps plus what was kept.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtrace.apis import stored_fields
from kvtrace.apis.chat import normalize_tools
from kvtrace.errors import UsageError
from kvtrace.rendering import parse_arguments
from kvtrace.store import (
    OnStep,
    ProviderApi,
    RunInfo,
    Step,
    Store,
    kinds,
    validate_run_name,
)
from kvtrace.store.objects import jsontext
from kvtrace.store.objects.encoding import canonical_json

UNKNOWN_MODEL = "unknown"


@dataclass(frozen=True, slots=True)
class ModelCallRecord:
    """One model call to record (arguments of `Run.record_model_call`).

    `messages`, `response`, `tools` and `system` are in the shape of `api`
    (OpenAI chat by default; Anthropic Messages or OpenAI Responses for the
    agents' own logs). With `continues` (OpenAI chat), `messages` holds only
    the messages after those of the previous model call record of the run
    (`Run.record_model_call(continues=True)`): a long conversation's records
    then hold each message once, and recording them costs what each adds.
    """

    messages: list[dict[str, Any]]
    response: dict[str, Any]
    model: str
    tools: list[dict[str, Any]] | None = None
    usage: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    api: ProviderApi = ProviderApi.OPENAI_CHAT
    system: Any = None
    continues: bool = False

    def check(self, where: str) -> None:
        """Refuse, naming `where`, a call the store would refuse (checked before any write)."""
        try:
            stored_fields(self.api, self.messages, self.response, tools=self.tools,
                          system=self.system)
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ToolCallRecord:
    """One tool call to record (arguments of `Run.record_tool_call`)."""

    name: str
    arguments: Any
    result: Any
    call_id: str | None = None
    error: str | None = None
    timings: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


Record = ModelCallRecord | ToolCallRecord


def record(store: Store, run: str, records: Sequence[Record], *,
           on_step: OnStep | None = None) -> RunInfo:
    """Record `records` as the steps of run `run`, which must be new or empty.

    Everything is written in one transaction (`Store.batch`): should the
    database fail half-way, or another writer append to the run meanwhile
    (the first append then loses its compare-and-swap), nothing is written.
    """
    validate_run_name(run)
    with store.batch():
        record_into(store, run, records, on_step=on_step)
    return run_info(store, run)


def run_info(store: Store, run: str) -> RunInfo:
    """The run `run` as `Store.runs` describes it."""
    return store.run_info(run)


def record_into(store: Store, run: str, records: Sequence[Record], *,
                on_step: OnStep | None = None) -> list[str]:
    """Append `records` to run `run`, which must be new or empty; the ids of the steps written.

    The caller holds the transaction (`Store.batch`): an importer that writes
    several runs (a session and its subagents) writes them all or none. Ids,
    not steps: a step holds its whole conversation, n steps would hold n.
    """
    writer = store.run(run)
    if writer.head is not None:
        raise UsageError(f"run {run!r} exists with {writer.head.depth} steps: "
                         "import under a new name (run=NAME)", param="run")
    ids: list[str] = []
    for item in records:
        if isinstance(item, ModelCallRecord):
            step = writer.record_model_call(
                item.messages, item.response, model=item.model, tools=item.tools,
                usage=item.usage, extra=item.extra or None, params=item.params,
                timings=item.timings, api=item.api, system=item.system,
                continues=item.continues,
            )
        else:
            step = writer.record_tool_call(
                item.name, item.arguments, item.result, call_id=item.call_id,
                error=item.error, timings=item.timings, extra=item.extra or None)
        ids.append(step.id)
        if on_step is not None:
            on_step(len(ids), len(records))
    return ids


def check_storable(document: Any, where: str = "the document") -> None:
    """Refuse, before anything is written, values the store cannot encode (NaN, lone surrogates)."""
    try:
        canonical_json(document)
    except UsageError as exc:
        raise UsageError(f"{where} cannot be stored: {exc}") from exc


def parse_json(data: bytes | str, source: str) -> Any:
    """A JSON document, or a one-line UsageError saying where it is not JSON.

    So is nesting deeper than the store holds, and an integer too long to
    convert (`jsontext.loads`).
    """

    def refuse_constant(name: str) -> Any:
        raise UsageError(f"{source}: {name} is not JSON (NaN and infinity cannot be stored)")

    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return jsontext.loads(text, source, parse_constant=refuse_constant)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{source} is not UTF-8 text (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{source} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc


def arguments_value(text: Any) -> Any:
    """Tool-call arguments as a JSON value (`parse_arguments`), or the text itself when its
    value cannot be stored (NaN, 1e400, nesting past the limit): a model may write anything."""
    value = parse_arguments(text)
    if value is not text:
        try:
            canonical_json(value)
        except UsageError:
            return text
    return value


def tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A tool list in the stored form; errors name `where` in the document."""
    try:
        return normalize_tools(value)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from exc


def keep(obj: Mapping[str, Any], mapped: set[str] | frozenset[str]) -> dict[str, Any]:
    """What `restore` needs to rebuild `obj`: its keys, and the values kvtrace does not map.

    A mapped key whose value is null or empty is kept as it is: the store
    drops nulls and empty lists, so the run cannot give them back.
    """
    fields = {k: v for k, v in obj.items() if k not in mapped or v in (None, [], {})}
    return {"keys": list(obj), "fields": fields}


def kept_lines(step: Step, key: str) -> dict[str, Any]:
    """What a JSON Lines import kept of a step's lines, under `meta.extra[key]`; nothing for
    an edited copy, which its export writes afresh (the kept lines are the original's)."""
    if kinds.edit_of(step) is not None:
        return {}
    typed = kinds.view(step)
    kept = typed.extra.get(key) if isinstance(typed, (kinds.ModelCall, kinds.ToolCall)) else None
    return kept if isinstance(kept, dict) else {}


def restore(mapped: Mapping[str, Any], kept: Mapping[str, Any] | None) -> dict[str, Any]:
    """An object rebuilt from the run (`mapped`) and what `keep` kept of the original.

    Without a kept record (a run kvtrace recorded itself) every mapped value
    that is not None is written.
    """
    if not isinstance(kept, Mapping):
        return {k: v for k, v in mapped.items() if v is not None}
    fields = kept.get("fields", {})
    out: dict[str, Any] = {}
    for key in kept.get("keys", []):
        if key in fields:
            out[key] = fields[key]
        elif mapped.get(key) is not None:
            out[key] = mapped[key]
    return out


class Answers:
    """The tool steps recorded after a model call, each taken at most once, in order.

    An export pairs the tool results its document shows with these steps by
    the call they answer; a call may be answered more than once (a retried
    tool), so the first step not yet taken wins. The steps no result took
    are `rest`.
    """

    def __init__(self, steps: Sequence[kinds.ToolCall]) -> None:
        self.steps = list(steps)
        self._taken: set[str] = set()  # step ids
        self._answers = deque(tool for tool in self.steps if tool.call_id is not None)
        self._by_call: dict[str, deque[kinds.ToolCall]] = {}
        for tool in self._answers:
            self._by_call.setdefault(tool.call_id or "", deque()).append(tool)

    def take(self, call_id: str | None = None) -> kinds.ToolCall | None:
        """The first step not taken that answers `call_id` (None: any call), or None."""
        queue = self._answers if call_id is None else self._by_call.get(call_id, deque())
        while queue:
            tool = queue.popleft()
            if tool.step.id not in self._taken:
                self._taken.add(tool.step.id)
                return tool
        return None

    def rest(self) -> list[kinds.ToolCall]:
        """The steps no result took, in order."""
        return [tool for tool in self.steps if tool.step.id not in self._taken]
