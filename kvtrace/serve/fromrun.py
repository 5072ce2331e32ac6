"""Answering from a recorded run first: `kvtrace record --from RUN@K` and `serve --from`.

An unchanged agent run again asks the model calls it asked when RUN was
recorded, for as long as nothing differs. `FromRecording` wraps the
server's answerer:

- while a request matches the recorded run's *next* model call up to step
  K (matched as `ReplayTransport` matches: path, model, conversation,
  tools, params; `stream` aside), it is answered from the recording at
  once, streamed when asked: nothing computed, nothing recorded;
- from the first request after step K, or the first that differs, answers
  are live (the inner answerer: the local engine, whose KV of the replayed
  prefix `warm` computed before the agent started, or the upstream), and
  recorded on a fork of RUN made at the last step both share: the fork's
  first steps are RUN's own steps, by id, and `kvtrace diff RUN FORK`
  shows where and why they parted;
- `edit` replaces fields of step K (a model call: its `response`, say),
  checked at once as `Store.fork(..., edit=...)` checks them: the agent is
  answered with the edited response and acts on it, and the fork starts
  from the edited copy. An agent that parts before step K never sees the
  edit: its fork starts where it parted, and the summary says so.

Requests are matched in order, one at a time (an agent's calls depend on
the answers before them); a request that arrives while the recorded part
is still being served waits for its turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import httpx
from starlette.responses import Response

from kvtrace.errors import UsageError
from kvtrace.store import ModelCall, Step, StepKind, Store
from kvtrace.store.edits import editable_fields, edited_content
from kvtrace.tracer.cassette import Cassette, served_response
from kvtrace.tracer.redact import Redactor

if TYPE_CHECKING:
    from starlette.requests import Request

    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve.answerer import Answerer
    from kvtrace.serve.recording import Sink


@dataclass(slots=True)
class FromSummary:
    """What the recorded part of a `--from` run did (for the CLI's closing line)."""

    spec: str
    fork: str
    num_recorded: int  # model calls the recording holds up to step K
    num_served: int = 0  # answered from the recording
    first_live_step: int | None = None  # depth on the fork of the first live call
    parted: str | None = None  # why the agent left the recording early (None: it did not)
    edit_seen: bool | None = None  # None: no edit; else whether the agent was answered with it
    reused_tokens: int | None = None  # the warm prefix's tokens reused by the live calls

    def line(self) -> str:
        """"6 calls answered from the recording, first live call at step 7, ..." """
        parts = [f"{self.num_served} of {self.num_recorded} recorded calls answered from "
                 f"the recording"]
        if self.first_live_step is not None:
            parts.append(f"first live call at step {self.first_live_step}")
        else:
            parts.append("no live call")
        if self.reused_tokens is not None:
            parts.append(f"{self.reused_tokens:,} prompt tokens reused")
        if self.parted:
            parts.append(f"parted early: {self.parted}")
        if self.edit_seen is False:
            parts.append("the edit of the last step was never served")
        return ", ".join(parts) + f" (fork: {self.fork})"

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "fork": self.fork, "num_recorded": self.num_recorded,
                "num_served": self.num_served, "first_live_step": self.first_live_step,
                "parted": self.parted, "edit_seen": self.edit_seen,
                "reused_tokens": self.reused_tokens}


@dataclass(slots=True)
class _Progress:
    """Where the agent is in the recording (guarded by FromRecording's lock)."""

    served: list[Step] = field(default_factory=list)
    is_live: bool = False


class FromRecording:
    """An answerer that answers from `spec`'s recorded model calls, then from `inner`."""

    def __init__(self, inner: Answerer, store: Store, spec: str, *, fork: str,
                 edit: Mapping[str, Any] | None = None,
                 redact_headers: tuple[str, ...] = ()) -> None:
        path = store.path(spec)
        if not path:
            raise UsageError(f"{spec!r} has no steps to answer from", param="spec")
        last = path[-1]
        if edit is not None and last.kind != StepKind.MODEL_CALL:
            raise UsageError(f"step {last.short_id} (#{last.depth}) is a {last.kind} step: "
                             "--edit changes a model call's response", param="edit")
        if fork in {info.name for info in store.runs()}:
            raise UsageError(f"run {fork!r} exists already: name the fork another way",
                             param="fork")
        self.inner = inner
        self._store = store
        self._spec = spec
        self._fork = fork
        self._edit = dict(edit) if edit is not None else None
        if self._edit is not None:  # checked now: a bad edit fails before the agent starts
            unknown = sorted(set(self._edit) - editable_fields(last))
            if unknown:
                raise UsageError(f"step {last.short_id} has no field {unknown[0]!r} to edit",
                                 param="edit")
            path = [*path[:-1], replace(last, content=edited_content(last, self._edit))]
        calls = [s for s in path if s.kind == StepKind.MODEL_CALL and ModelCall(s).http]
        self._cassette = Cassette(calls, Redactor(redact_headers))
        self._calls = calls
        self._progress = _Progress()
        self._lock = asyncio.Lock()
        self.summary = FromSummary(spec, fork, len(calls),
                                   edit_seen=False if self._edit is not None else None)

    @property
    def model(self) -> str | None:
        return self.inner.model

    @property
    def description(self) -> str:
        return (f"{self.inner.description}, after the {len(self._calls)} recorded calls of "
                f"{self._spec}")

    def health(self) -> dict[str, Any]:
        return {**self.inner.health(), "from": self.summary.to_dict()}

    async def close(self) -> None:
        await self.inner.close()

    async def answer(self, request: Request, body: bytes, sink: Sink) -> Response:
        async with self._lock:
            if not self._progress.is_live:
                served = self._next_recorded(request, body)
                if served is not None:
                    return served
                await asyncio.to_thread(self._go_live)
        return await self.inner.answer(request, body, sink)

    def _next_recorded(self, request: Request, body: bytes) -> Response | None:
        """The recorded answer when `request` is the next recorded call, else None."""
        if request.method != "POST":
            return None
        index = len(self._progress.served)
        if index >= len(self._calls):
            return None
        live = httpx.Request("POST", str(request.url), headers=list(request.headers.items()),
                             content=body)
        expected = self._calls[index]
        if self._cassette.key(live) != self._cassette.step_key(expected):
            self.summary.parted = self._cassette.explain_miss(live) if index else (
                "the first request differs from the recording's first call")
            return None
        self._progress.served.append(expected)
        self.summary.num_served += 1
        if self._edit is not None and index == len(self._calls) - 1:
            self.summary.edit_seen = True
        recorded = served_response(expected, live)
        return Response(recorded.content, status_code=recorded.status_code,
                        headers={k: v for k, v in recorded.headers.items()
                                 if k.lower() not in ("content-length", "content-encoding")})

    def _go_live(self) -> None:
        """Make the fork at the last step the agent and the recording share."""
        self._progress.is_live = True
        served = self._progress.served
        if self._edit is not None and len(served) == len(self._calls):
            head = self._store.fork(self._spec, self._fork, edit=self._edit).head
        elif served:
            head = self._store.fork(served[-1].id, self._fork).head
        else:
            head = None  # parted at the first call: the fork starts empty
        self.summary.first_live_step = (head.depth + 1) if head is not None else 1


def warm(store: Store, spec: str, backend: LocalBackend) -> int:
    """Rebuild `spec`'s model calls through `backend`, so its KV is cached before the agent
    starts; returns the tokens now cached (what the first live call can reuse)."""
    from kvtrace.replay.driver import replay

    report = replay(store, spec, backend, mode="rebuild")
    return report.total.prompt_tokens
