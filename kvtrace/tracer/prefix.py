"""A recorded run's first K model calls, served in order, then the live part on a fork.

What `kvtrace record --from RUN@K` (serve/fromrun.py) and
`ReplayTransport(run, until=K)` share. An unchanged agent run again asks
the model calls it asked when RUN was recorded, for as long as nothing
differs. `RecordedPrefix.serve(request)` gives the recorded step that
answers `request` while it matches the recording's *next* model call up to
step K (matched as `ReplayTransport` matches: path, model, conversation,
tools, params; `stream` aside), else None: the agent has left the
recording, for good. `go_live()` then makes the fork the live part is
recorded on, at the last step both share, so the fork's first steps are
RUN's own steps by id and `kvtrace diff RUN FORK` shows where they parted.

`edit` replaces fields of step K (a model call: its `response`, say),
checked at once as `Store.fork(..., edit=...)` checks them: the agent is
answered with the edited response and acts on it, and the fork starts from
the edited copy. An agent that parts before step K never sees the edit; its
fork starts where it parted, and the summary says so. Requests are taken in
order (an agent's calls depend on the answers before them): callers
serialise `serve` and `go_live`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx

from kvtrace.errors import UsageError
from kvtrace.store import ModelCall, Run, Step, StepKind, Store
from kvtrace.store.edits import editable_fields, edited_content
from kvtrace.tracer.cassette import Cassette
from kvtrace.tracer.redact import Redactor


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
                 redact_headers: tuple[str, ...] = ()) -> None:
        path = store.path(spec)
        if not path:
            raise UsageError(f"{spec!r} has no steps to answer from", param="spec")
        last = path[-1]
        if edit is not None:  # checked now: a bad edit fails before the agent starts
            if last.kind != StepKind.MODEL_CALL:
                raise UsageError(f"step {last.short_id} (#{last.depth}) is a {last.kind} step: "
                                 "an edit changes a model call's response", param="edit")
            unknown = sorted(set(edit) - editable_fields(last))
            if unknown:
                raise UsageError(f"step {last.short_id} has no field {unknown[0]!r} to edit",
                                 param="edit")
            path = [*path[:-1], replace(last, content=edited_content(last, edit))]
        if fork in {info.name for info in store.runs()}:
            raise UsageError(f"run {fork!r} exists already: name the fork another way",
                             param="fork")
        self._store = store
        self._spec = spec
        self._fork = fork
        self._edit = dict(edit) if edit is not None else None
        self._calls = [s for s in path if s.kind == StepKind.MODEL_CALL and ModelCall(s).http]
        self._cassette = Cassette(self._calls, Redactor(redact_headers))
        self._served: list[Step] = []
        self.is_live = False
        self.summary = PrefixSummary(spec, fork, len(self._calls),
                                     edit_seen=False if edit is not None else None)

    @property
    def served(self) -> tuple[Step, ...]:
        """The recorded steps served so far, in order."""
        return tuple(self._served)

    def serve(self, request: httpx.Request) -> Step | None:
        """The recorded step that answers `request` (the recording's next call), else None."""
        if self.is_live:
            return None
        index = len(self._served)
        if index >= len(self._calls):
            return None
        expected = self._calls[index]
        if self._cassette.key(request) != self._cassette.step_key(expected):
            self.summary.parted = (self._cassette.explain_miss(request) if index else
                                   "the first request differs from the recording's first call")
            return None
        self._served.append(expected)
        self.summary.num_served += 1
        if self._edit is not None and index == len(self._calls) - 1:
            self.summary.edit_seen = True
        return expected

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
    taken = {info.name for info in store.runs()}
    name, number = base, 1
    while name in taken:
        number += 1
        name = f"{base}-{number}"
    return name
