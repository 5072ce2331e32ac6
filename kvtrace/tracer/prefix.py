"""A recorded run's first K model calls, served in order, then the live part on a fork.

What `kvtrace record --from RUN@K` (serve/fromrun.py) and
`ReplayTransport(run, until=K)` share. An unchanged agent run again asks
the model calls it asked when RUN was recorded, for as long as nothing
differs. `RecordedPrefix.serve(request)` gives the recorded step that
answers `request` while it matches the recording's *next* model call up to
step K (matched as `ReplayTransport` matches: path, model, conversation,
tools, params; `stream` aside), else None: the agent has left the
recording, for good. A recorded answer cut before its end (`kinds.is_cut`)
answers nothing: the call goes live there. `go_live()` then makes the fork the live part is
recorded on, at the last step both share, so the fork's first steps are
RUN's own steps by id and `kvtrace diff RUN FORK` shows where they parted.

`edit` replaces fields of step K (a model call: its `response`, say),
checked at once as `Store.fork(..., edit=...)` checks them: the agent is
answered with the edited response and acts on it, and the fork starts from
the edited copy. An agent that parts before step K never sees the edit; its
fork starts where it parted, and the summary says so. Requests are taken in
order (an agent's calls depend on the answers before them): callers
serialise `serve` and `go_live`.

With `tools=True` (the tracer's replay mode, `kvtrace.replaying`,
replay_mode.py) the steps served in order are the agent's tool calls
(`serve_tool`: same tool, same arguments as JSON) and its other HTTP
exchanges too, all in the one recorded order, so that a tool call where
the recording has a model call, or the other way round, is where the two
part. An edit of step K may then change a tool call's `result`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx

from kvtrace.apis.plain import to_plain
from kvtrace.errors import UsageError
from kvtrace.store import HttpExchange, ModelCall, Run, Step, StepKind, Store, ToolCall
from kvtrace.store.edits import editable_fields, edited_content
from kvtrace.store.kinds import is_cut
from kvtrace.tracer.endpoints import endpoint_for
from kvtrace.tracer.exchange import is_chat_completions
from kvtrace.tracer.matching import Cassette, difference
from kvtrace.tracer.redact import Redactor

_SNIPPET = 80


@dataclass(slots=True)
class PrefixSummary:
    """What the recorded part did (for the CLI's closing line and --json)."""

    spec: str
    fork: str
    num_recorded: int  # model calls the recording holds up to step K
    num_served: int = 0  # answered from the recording
    first_live_step: int | None = None  # depth on the fork of the first live step
    parted: str | None = None  # why the agent left the recording early (None: it did not)
    edit_seen: bool | None = None  # None: no edit; else whether the agent was answered with it

    def line(self, reused_tokens: int | None = None) -> str:
        """"6 of 6 recorded calls answered from the recording, first live call at step 7..." """
        parts = [f"{self.num_served} of {self.num_recorded} recorded calls answered from the "
                 "recording",
                 f"first live call at step {self.first_live_step}"
                 if self.first_live_step is not None else "no live call"]
        if reused_tokens is not None:
            parts.append(f"{reused_tokens:,} prompt tokens reused")
        if self.parted:
            parts.append(f"parted early: {self.parted}")
        if self.edit_seen is False:
            parts.append("the edited step was never served")
        return ", ".join(parts) + f" (fork: {self.fork})"

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "fork": self.fork, "num_recorded": self.num_recorded,
                "num_served": self.num_served, "first_live_step": self.first_live_step,
                "parted": self.parted, "edit_seen": self.edit_seen}


class RecordedPrefix:
    """`spec`'s recorded model calls (up to its step K), served in order; see the module doc."""

    def __init__(self, store: Store, spec: str, *, fork: str,
                 edit: Mapping[str, Any] | None = None,
                 redact_headers: tuple[str, ...] = (), tools: bool = False) -> None:
        path = store.path(spec)
        if not path:
            raise UsageError(f"{spec!r} has no steps to answer from", param="spec")
        if edit is not None:  # checked now: a bad edit fails before the agent starts
            path = [*path[:-1], _edited(path[-1], edit, tools=tools)]
        if store.has_run(fork):
            raise UsageError(f"run {fork!r} exists already: name the fork another way",
                             param="fork")
        self._store = store
        self._spec = spec
        self._fork = fork
        self._edit = dict(edit) if edit is not None else None
        self._calls = [s for s in path if _is_served(s, tools=tools)]
        self._cassette = Cassette(self._calls, Redactor(redact_headers))
        self._served: list[Step] = []
        self.is_live = False
        self.summary = PrefixSummary(spec, fork, len(self._calls),
                                     edit_seen=False if edit is not None else None)

    @classmethod
    def of_run(cls, store: Store, name: str, until: int, *, fork: str | None = None,
               edit: Mapping[str, Any] | None = None, redact_headers: tuple[str, ...] = (),
               tools: bool = False) -> RecordedPrefix:
        """Run `name`'s steps 1..`until`; the fork named `fork`, by default `NAME-from-K`."""
        if isinstance(until, bool) or not isinstance(until, int) or until < 1:
            raise UsageError(f"until must be a step number >= 1, not {until!r}", param="until")
        return cls(store, f"{name}@{until}",
                   fork=fork or free_fork_name(store, f"{name}-from-{until}"),
                   edit=edit, redact_headers=redact_headers, tools=tools)

    @property
    def served(self) -> tuple[Step, ...]:
        """The recorded steps served so far, in order."""
        return tuple(self._served)

    def serve(self, request: httpx.Request) -> Step | None:
        """The recorded step that answers `request` (the recording's next call), else None."""
        expected = self._next()
        if expected is None:
            return None
        if expected.kind == StepKind.TOOL_CALL:
            key = self._cassette.key(request)
            return self._part(f"{key.method} {key.url} was sent where the recording's next "
                              f"step is {_described(expected)}")
        key, recorded = self._cassette.key(request), self._cassette.step_key(expected)
        if key != recorded:
            which = "the request" if self._served else "the first request"
            how = difference(key, recorded) if recorded is not None else "it holds no request"
            return self._part(f"{which} differs from {_described(expected)}: {how}")
        if is_cut(expected):
            return self._part(f"{_described(expected)} was cut before its end (the client left "
                              "mid-stream): asked live")
        return self._take(expected)

    def serve_tool(self, name: str, arguments: Any) -> Step | None:
        """The recorded tool call that answers calling tool `name` with `arguments` (JSON
        data, as the tool decorator records them) when it is the recording's next step."""
        expected = self._next()
        if expected is None:
            return None
        called = f"tool {name}({_snippet(arguments)})"
        if expected.kind != StepKind.TOOL_CALL:
            return self._part(f"{called} was called where the recording's next step is "
                              f"{_described(expected)}")
        recorded = ToolCall(expected)
        if recorded.tool != name or _canonical(recorded.arguments) != _canonical(arguments):
            return self._part(f"{called} differs from {_described(expected)}")
        return self._take(expected)

    def _next(self) -> Step | None:
        """The recording's next step to serve (None: live, or all were served)."""
        if self.is_live or len(self._served) >= len(self._calls):
            return None
        return self._calls[len(self._served)]

    def _part(self, why: str) -> Step | None:
        """None, the agent having left the recording for the reason `why`."""
        self.summary.parted = why
        return None

    def _take(self, step: Step) -> Step:
        self._served.append(step)
        self.summary.num_served += 1
        if self._edit is not None and len(self._served) == len(self._calls):
            self.summary.edit_seen = True
        return step

    def go_live(self) -> Run:
        """The run the live part is recorded on: the fork, made once, where the two parted."""
        if not self.is_live:
            self.is_live = True
            served = self._served
            if self._edit is not None and len(served) == len(self._calls):
                head = self._store.fork(self._spec, self._fork, edit=self._edit).head
            elif served:
                head = self._store.fork(served[-1].id, self._fork).head
            else:
                head = None  # parted at the first call: the fork starts empty
            self.summary.first_live_step = head.depth + 1 if head is not None else 1
        return self._store.run(self._fork)


def free_fork_name(store: Store, base: str) -> str:
    """`base`, or `base-2`, `base-3`... : the first name no run has."""
    name, number = base, 1
    while store.has_run(name):
        number += 1
        name = f"{base}-{number}"
    return name


def _is_served(step: Step, *, tools: bool) -> bool:
    """Whether the agent's own call is answered with `step` (a model call made over HTTP;
    with `tools`, also a tool call and an HTTP exchange that is no model API's answer)."""
    if step.kind == StepKind.MODEL_CALL:
        return ModelCall(step).http is not None
    if not tools:
        return False
    if step.kind == StepKind.TOOL_CALL:
        return True
    if step.kind == StepKind.HTTP:  # a model API's error answer: the agent retried it
        exchange = HttpExchange(step)
        return not (is_chat_completions(exchange.method, exchange.url)
                    or endpoint_for(exchange.method, exchange.url) is not None)
    return False


def _edited(step: Step, edit: Mapping[str, Any], *, tools: bool) -> Step:
    """`step` (step K) with `edit` applied, or a UsageError saying why it does not fit."""
    what = "a model call's response or a tool call's result" if tools else (
        "a model call's response")
    if not _is_served(step, tools=tools) or step.kind == StepKind.HTTP:
        how = " recorded by hand" if step.kind == StepKind.MODEL_CALL else ""
        raise UsageError(f"step {step.short_id} (#{step.depth}) is a {step.kind} step{how}: "
                         f"an edit changes {what}", param="edit")
    if not isinstance(edit, Mapping) or not edit:
        raise UsageError("edit must map step K's fields to their new values", param="edit")
    unknown = sorted(set(edit) - editable_fields(step))
    if unknown:
        raise UsageError(f"step {step.short_id} has no field {unknown[0]!r} to edit",
                         param="edit")
    if step.kind == StepKind.TOOL_CALL:
        error = ToolCall(step).error
        if error is not None and "result" in edit:
            raise UsageError(f"step {step.short_id} (#{step.depth}) recorded an error "
                             f"({error}), not a result to edit", param="edit")
        for key, value in edit.items():
            try:
                json.dumps(to_plain(value), allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise UsageError(f"edit {key!r} must be JSON data, not "
                                 f"{type(value).__name__}", param="edit") from exc
    return replace(step, content=edited_content(step, edit))


def _described(step: Step) -> str:
    """A recorded step in a few words, for why the agent parted."""
    where = f"step {step.short_id} (#{step.depth})"
    if step.kind == StepKind.TOOL_CALL:
        call = ToolCall(step)
        return f"{where}, tool {call.tool}({_snippet(call.arguments)})"
    if step.kind == StepKind.HTTP:
        exchange = HttpExchange(step)
        return f"{where}, {exchange.method} {exchange.url}"
    return f"{where}, a model call"


def _canonical(value: Any) -> str:
    return json.dumps(to_plain(value), sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"), default=repr)


def _snippet(arguments: Any) -> str:
    text = _canonical(arguments)
    return text if len(text) <= _SNIPPET else text[:_SNIPPET] + "..."
