"""What `kvtrace serve` records, and where: the run of each request, one store writer thread.

A request is recorded into the fork of the agent it came from (`kvtrace
record --n K`, agents.py), else the run its `X-Kvtrace-Run` header names, else
the server's default run (given, or named at start: `serve-YYYYMMDD-HHMMSS`).
`Recording.sink(request)` decides once per request where its step goes: a
`RunSink` on that run, or `DISCARD` when the server was given no store. An
answerer hands its sink a `StepWrite` (a function of the run's `Recorder`
and the server's `Redactor` that writes one step, e.g. capture.py's
`record_exchange`) and never asks whether it is recording; an answer that
must not be recorded (a 4xx from the upstream) is sent to `DISCARD`.

Store writes run on one worker thread, so the event loop never waits on the
database, through one `Recorder` per run, kept for the runs written last
(`MAX_RECORDERS`): each holds its run's head step, content and all, so a
server recording into ever new runs (one per agent session, say) must not
keep every one; a run written again later reads its head back once.
`record` waits for its write (an answer goes out once its step is stored; a
write once asked for is made, even if the waiting is cancelled),
`record_later` does not (a stream the client dropped: nobody waits for it).
A bad run name in the header is a 400, checked before anything is read,
answered or recorded. A run a supervisor paused is a 409
(`run_paused`), checked before anything is computed or forwarded
(`Sink.check_open`); a pause that lands while an answer is computed is the
same 409 at the append, the answer not delivered (a stream already under
way ends with that error as its last event, in place of its closing one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from kvtrace.errors import RunNotFoundError, RunPausedError, StoreFullError, UsageError
from kvtrace.serve.agents import agent_of
from kvtrace.serve.request import APIError
from kvtrace.store import ModelCall, Step, StepKind, Store, validate_run_name
from kvtrace.tracer.recorder import Recorder
from kvtrace.tracer.redact import Redactor

if TYPE_CHECKING:
    from pathlib import Path

    from starlette.requests import Request

    from kvtrace.workspace import Snapshotter

RUN_HEADER = "x-kvtrace-run"
MAX_RECORDERS = 64  # runs whose Recorder (and head step) the writer keeps (module docstring)
FULL_PROBE_S = 5.0  # after a full-disk failure, requests are refused up front this long
_log = logging.getLogger("uvicorn.error")  # where uvicorn logs its own errors
StepWrite = Callable[[Recorder, Redactor], Step]


@dataclass(slots=True)
class RunStats:
    """What a server recorded into one run (for `kvtrace record`'s summary)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    unknown_cached: int = 0  # calls whose server did not report cached tokens
    other_steps: int = 0

    def add(self, step: Step) -> None:
        if step.kind != StepKind.MODEL_CALL:
            self.other_steps += 1
            return
        usage = ModelCall(step).usage
        self.calls += 1
        self.prompt_tokens += usage.prompt_tokens or 0
        self.completion_tokens += usage.completion_tokens or 0
        if usage.cached_tokens is None:
            self.unknown_cached += 1
        else:
            self.cached_tokens += usage.cached_tokens


class Sink(Protocol):
    """Where one answer's step goes."""

    async def check_open(self, *, is_answered: bool = False) -> None:
        """Raise APIError (409) when a step cannot go there now: the run is paused
        (`is_answered`: the answer is computed already, and will not be delivered)."""

    async def record(self, write: StepWrite) -> None:
        """Write the step and wait until it is stored."""

    def record_later(self, write: StepWrite) -> None:
        """Write the step without waiting for it."""

    async def snapshot(self) -> None:
        """Take the run's workspace snapshot, if it has one, for the step this request
        writes (called once, before the answer is computed)."""


class _Discard:
    """The sink of an answer that is not recorded."""

    async def check_open(self, *, is_answered: bool = False) -> None:
        return None

    async def record(self, write: StepWrite) -> None:
        return None

    def record_later(self, write: StepWrite) -> None:
        return None

    async def snapshot(self) -> None:
        return None


DISCARD: Sink = _Discard()


class Recording:
    """The store a server records into (None: nothing is recorded), its runs and their stats."""

    def __init__(self, store: Store | None, *, run: str | None = None,
                 redact_headers: Iterable[str] = ()) -> None:
        self.store = store
        self.default_run = validate_run_name(run) if run is not None else new_run_name(store)
        self.stats: dict[str, RunStats] = {}
        self._writer = (StoreWriter(store, Redactor(redact_headers), self.stats)
                        if store is not None else None)

    def snapshot_workspace(self, run: str, folder: Path) -> None:
        """Snapshot `folder` before each model call recorded into `run` (`record --workspace`;
        kvtrace/workspace): the call's meta names the tree."""
        if self._writer is not None:
            self._writer.watch_workspace(run, folder)

    def sink(self, request: Request) -> Sink:
        """Where the answer to `request` is recorded (the run header checked here): the
        fork of the agent it came from (agents.py), else the run its header names."""
        agent = agent_of(request)
        if agent is not None:
            return RunSink(self._writer, agent.fork) if self._writer is not None else DISCARD
        name = request.headers.get(RUN_HEADER)
        try:
            run = validate_run_name(name) if name is not None else self.default_run
        except UsageError as exc:
            raise APIError(400, f"header X-Kvtrace-Run: {exc}", param=RUN_HEADER,
                           code="invalid_value") from exc
        return RunSink(self._writer, run) if self._writer is not None else DISCARD

    def close(self) -> None:
        """Wait for the writes still queued, then stop the writer thread."""
        if self._writer is not None:
            self._writer.close()

    @property
    def unrecorded(self) -> tuple[int, str | None]:
        """(answers not recorded because the store's disk was full, the last reason)."""
        if self._writer is None:
            return 0, None
        return self._writer.num_unrecorded, self._writer.full_reason


class StoreWriter:
    """Writes steps into a store's runs on one thread, one Recorder per run; counts them."""

    def __init__(self, store: Store, redactor: Redactor, stats: dict[str, RunStats]) -> None:
        self._store = store
        self._snapshotters: dict[str, Snapshotter] = {}  # by run: `record --workspace`
        self._redactor = redactor
        self._stats = stats
        self._recorders: OrderedDict[str, Recorder] = OrderedDict()  # last written, last
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvtrace-store")
        self.num_unrecorded = 0  # answers a full store disk did not take (`_full`)
        self.full_reason: str | None = None
        self._full_at: float | None = None  # when the last write found the disk full

    async def check_open(self, run: str, *, is_answered: bool = False) -> None:
        if self._full_at is not None:
            if time.monotonic() - self._full_at < FULL_PROBE_S:
                # The disk was full a moment ago: refused before any work, so that an agent's
                # retries do not compute answers nobody can record.
                raise store_full_error(self.full_reason or "", is_answered=False)
            self._full_at = time.monotonic()  # this one probes; the others wait FULL_PROBE_S
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(self._worker, self._is_paused, run):
            raise paused_error(run, is_answered=is_answered)

    def watch_workspace(self, run: str, folder: Path) -> None:
        from kvtrace.workspace import Snapshotter

        previous = self._snapshotters.pop(run, None)
        if previous is not None:
            previous.close()
        self._snapshotters[run] = Snapshotter(self._store, folder)

    async def snapshot(self, run: str) -> str | None:
        """The run's workspace snapshot, taken now on the writer's thread (None: none taken)."""
        snapshotter = self._snapshotters.get(run)
        if snapshotter is None:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, snapshotter.take)

    async def record(self, run: str, write: StepWrite, workspace: str | None = None) -> None:
        loop = asyncio.get_running_loop()
        try:  # shielded: a write the caller stops waiting for (its client left) still happens
            await asyncio.shield(loop.run_in_executor(self._worker, self._write, run, write,
                                                      workspace))
        except RunPausedError as exc:  # paused after check_open, while the answer was computed
            raise paused_error(run, is_answered=True) from exc
        except StoreFullError as exc:
            raise store_full_error(str(exc), is_answered=True) from exc

    def record_later(self, run: str, write: StepWrite, workspace: str | None = None) -> None:
        self._worker.submit(self._write_later, run, write, workspace)

    def _write_later(self, run: str, write: StepWrite, workspace: str | None) -> None:
        """`_write` for an answer already sent (a stream): a full disk is counted and logged,
        not raised into a future nobody reads."""
        with contextlib.suppress(StoreFullError):
            self._write(run, write, workspace)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        for snapshotter in self._snapshotters.values():
            snapshotter.close()

    def _is_paused(self, run: str) -> bool:
        try:
            return self._store.is_paused(run)
        except RunNotFoundError:  # made by its first step: not paused
            return False

    def _write(self, run: str, write: StepWrite, workspace: str | None = None) -> Step:
        try:
            recorder = self._recorders.get(run)
            if recorder is None:  # a new run is written too: inside, for a full disk
                recorder = self._recorders[run] = Recorder(self._store.run(run))
                if len(self._recorders) > MAX_RECORDERS:
                    self._recorders.popitem(last=False)
            self._recorders.move_to_end(run)
            recorder.workspace = workspace  # one writer thread: no other write sees it
            try:
                step = write(recorder, self._redactor)
            finally:
                recorder.workspace = None
        except StoreFullError as exc:
            self._full(str(exc))
            raise
        self._full_at = None
        self._stats.setdefault(run, RunStats()).add(step)
        return step

    def _full(self, reason: str) -> None:
        """One answer not recorded for a full disk: counted, and said once per spell in the
        server's log (one line, no traceback)."""
        self.num_unrecorded += 1
        if self._full_at is None:
            _log.error("kvtrace serve: %s; answers are refused (507) until it has room",
                       reason)
        self.full_reason = reason
        self._full_at = time.monotonic()


@dataclass(slots=True)
class RunSink:
    """A sink on one run of the store (and the workspace snapshot its request was asked in)."""

    writer: StoreWriter
    run: str
    workspace: str | None = None

    async def check_open(self, *, is_answered: bool = False) -> None:
        await self.writer.check_open(self.run, is_answered=is_answered)

    async def snapshot(self) -> None:
        self.workspace = await self.writer.snapshot(self.run)

    async def record(self, write: StepWrite) -> None:
        await self.writer.record(self.run, write, self.workspace)

    def record_later(self, write: StepWrite) -> None:
        self.writer.record_later(self.run, write, self.workspace)


def store_full_error(reason: str, *, is_answered: bool) -> APIError:
    """The answer when the store's disk is full: a 507 the SDKs do not retry (`x-should-retry`),
    so no retry computes an answer again that cannot be recorded either."""
    what = ("the answer was computed but neither recorded nor delivered" if is_answered
            else "nothing was computed or recorded")
    return APIError(507, f"kvtrace serve cannot record: {reason} ({what})",
                    kind="server_error", code="store_full", headers={"x-should-retry": "false"})


def paused_error(run: str, *, is_answered: bool = False) -> APIError:
    """The answer to a request for a paused run (`is_answered`: paused while it was answered)."""
    what = ("it was paused while this request was answered: the answer was neither recorded "
            "nor delivered whole" if is_answered
            else "nothing was computed, forwarded or recorded")
    return APIError(409, f"run {run!r} is paused by a supervisor ({what}); retry once it is "
                    "resumed", kind="conflict_error", param=RUN_HEADER, code="run_paused")


def new_run_name(store: Store | None, prefix: str = "serve") -> str:
    """A run name no run has yet: PREFIX-YYYYMMDD-HHMMSS (UTC), with -N appended if taken."""
    base = f"{prefix}-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    name, number = base, 1
    while store is not None and store.has_run(name):
        number += 1
        name = f"{base}-{number}"
    return name
