"""Replay many runs through one backend, with up to N requests in flight, into one report.

Within a run, steps are replayed in order: each request's prompt is the
conversation so far, and the cache it should hit is the one the previous
step left. So concurrency is across runs: up to `concurrency` runs replay at
once, each with one request in flight, on a pool of threads; a server with
N parallel slots then works on N requests at a time.

`select_runs` turns what a user names into run names: names or step
addresses, shell-style globs over run names (`eval-*`; run names cannot
hold `* ? [`), or every run that has steps. Everything is checked before the
first request: an unknown run, a glob that matches nothing or a bad
`concurrency` raises, and nothing is sent.

A run that fails (its backend still failing after the backend's retries, a
prompt longer than the model's context) is reported failed with a one-line
reason and the step it stopped at; the others go on. `RunsReport` lists
every run in the order given, each with its `ReplayReport`, and a total
over every replayed step.

Each run's oracle bound is its own (the run as if replayed alone on an
empty cache), so a run's report does not depend on what ran beside it. A
server's cache is shared by all runs, though: runs that share a prefix (a
system prompt) can make a run's first call reuse more than its own bound,
and which run got there first depends on the schedule.

Threads: the store is read on the calling thread only, one run's steps when
a slot frees up (memory holds the steps of at most `concurrency` runs); a
worker gets a list of steps and never touches the store. The tokenizer is
shared behind a lock (a fast Hugging Face tokenizer may refuse concurrent
calls), unless it says it is thread-safe (`is_thread_safe`: the engine's own,
over HTTP). `progress` is called from the worker threads. If the caller is
interrupted, every run stops after the request it has in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from enum import StrEnum
from fnmatch import fnmatchcase
from typing import Any, Protocol

from kvtrace.errors import KvtraceError, UsageError
from kvtrace.replay.backend import Backend, Tokenizer
from kvtrace.replay.driver import cold_start, replay_mode, replay_steps, steps_to_replay
from kvtrace.replay.engines import EngineFacts, counters_grown
from kvtrace.replay.report import ReplayMode, ReplayReport, StepReport, Totals
from kvtrace.store import Step, Store
from kvtrace.store.kinds import StepKind

GLOB_CHARACTERS = "*?["


class RunStatus(StrEnum):
    """How one run of a many-run replay ended."""

    OK = "ok"  # every step replayed (and, in verify, reproduced)
    DIFFERS = "differs"  # verify: replayed, but a step did not reproduce its recording
    FAILED = "failed"  # stopped early: `RunOutcome.error` says why


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """One run of a many-run replay: its report, or why it failed and where."""

    run: str
    report: ReplayReport | None  # None when the run failed
    wall_s: float
    error: str | None = None  # one line
    failed_at: int | None = None  # depth (RUN@N) of the model call that failed
    num_done: int = 0  # model calls replayed before it failed

    @property
    def status(self) -> RunStatus:
        if self.report is None:
            return RunStatus.FAILED
        return RunStatus.DIFFERS if self.report.is_match is False else RunStatus.OK

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "status": str(self.status),
            "error": self.error,
            "failed_at": self.failed_at,
            "num_done": self.num_done if self.report is None else len(self.report.steps),
            "wall_s": round(self.wall_s, 4),
            "report": None if self.report is None else self.report.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class RunsReport:
    """The outcome of `replay_runs`: every run in the order given, and the total."""

    mode: ReplayMode
    backend: str
    model: str
    concurrency: int
    runs: list[RunOutcome]
    wall_s: float
    engine: EngineFacts | None = None  # a remote engine: its tokens and blocks (engines.py)
    engine_counters: dict[str, int] | None = None  # what its cache counters grew by, in all
    reset: str | None = None  # the endpoint that emptied the engine's cache first, if asked
    notes: list[str] = field(default_factory=list)  # the replay's own (each run has its own)

    @property
    def total(self) -> Totals:
        """Sums over every step replayed, failed runs' steps excluded (they have no report)."""
        return Totals.of([step for outcome in self.runs if outcome.report is not None
                          for step in outcome.report.steps])

    @property
    def failed(self) -> list[RunOutcome]:
        return [outcome for outcome in self.runs if outcome.status is RunStatus.FAILED]

    @property
    def differing(self) -> list[RunOutcome]:
        return [outcome for outcome in self.runs if outcome.status is RunStatus.DIFFERS]

    @property
    def is_ok(self) -> bool:
        """Every run replayed (and, in verify, reproduced)."""
        return all(outcome.status is RunStatus.OK for outcome in self.runs)

    def to_dict(self) -> dict[str, Any]:
        total = self.total.to_dict()
        del total["first_mismatch"]  # an index within one run: see each run's report
        total.update({
            "runs": len(self.runs),
            "ok_runs": len(self.runs) - len(self.failed) - len(self.differing),
            "differing_runs": len(self.differing),
            "failed_runs": len(self.failed),
            "tool_steps": sum(o.report.tool_steps for o in self.runs if o.report is not None),
            "wall_s": round(self.wall_s, 4),
        })
        return {
            "mode": str(self.mode),
            "backend": self.backend,
            "model": self.model,
            "concurrency": self.concurrency,
            "runs": [outcome.to_dict() for outcome in self.runs],
            "total": total,
            "engine": None if self.engine is None else self.engine.to_dict(),
            "engine_counters": self.engine_counters,
            "reset": self.reset,
            "notes": list(self.notes),
        }


class RunsProgress(Protocol):
    """What `replay_runs` reports as it goes (called from its worker threads)."""

    def run_started(self, run: str, num_calls: int) -> None: ...

    def step_done(self, run: str, done: int, total: int, step: StepReport) -> None: ...

    def run_finished(self, outcome: RunOutcome) -> None: ...


def select_runs(store: Store, names: Sequence[str] = (), *, every: bool = False) -> list[str]:
    """The runs `names` stand for, in order, each once: names or step addresses, or globs.

    A glob (`eval-*`, `trial-[0-4]`) matches run names (`fnmatch` rules,
    case-sensitive); `every=True` takes every run that has steps. A name that
    resolves to nothing raises NotFoundError, a glob that matches nothing
    UsageError.
    """
    if every and names:
        raise UsageError("name runs, or ask for every run, not both", param="every")
    if not every and not names:
        raise UsageError("name at least one run (or a glob), or ask for every run",
                         param="every")
    with_steps = [info.name for info in store.runs() if info.head_id is not None] if (
        every or any(is_glob(name) for name in names)) else []
    if every:
        if not with_steps:
            raise UsageError("the store has no run with steps to replay")
        return with_steps
    chosen: dict[str, None] = {}
    for name in names:
        if is_glob(name):
            matched = [run for run in with_steps if fnmatchcase(run, name)]
            if not matched:
                raise UsageError(f"no run with steps matches {name!r} (of "
                                 f"{len(with_steps)} such runs)")
            chosen.update(dict.fromkeys(matched))
        else:
            store.resolve(name)  # RunNotFoundError / StepNotFoundError before any request
            chosen[name] = None
    return list(chosen)


def replay_runs(
    store: Store,
    runs: Sequence[str],
    backend: Backend,
    *,
    concurrency: int = 1,
    mode: ReplayMode | str = ReplayMode.REBUILD,
    use_drafts: bool = True,
    progress: RunsProgress | None = None,
    reset_cache: bool = False,
) -> RunsReport:
    """Replay each of `runs` (names or step addresses, see `select_runs`) from its root.

    Up to `concurrency` runs at once, each with one request in flight; more
    than one needs a backend that takes concurrent calls
    (`backend.is_concurrent`: a remote server, a batching local backend).
    `reset_cache` empties a remote engine's cache once, before the first run.
    """
    mode = replay_mode(mode)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise UsageError(f"concurrency must be a whole number >= 1, not {concurrency!r}",
                         param="concurrency")
    names = list(dict.fromkeys(runs))
    if not names:
        raise UsageError("no runs to replay: name at least one", param="runs")
    for name in names:
        store.resolve(name)  # an unknown run fails here, before any request
    if concurrency > 1 and not backend.is_concurrent:
        raise UsageError(
            f"the backend {backend.name!r} answers one call at a time: replay with "
            "concurrency=1, or through a backend that takes concurrent calls (a remote "
            "server)", param="concurrency")
    tokenizer = backend.tokenizer
    if tokenizer is not None and not getattr(tokenizer, "is_thread_safe", False):
        tokenizer = _SharedTokenizer(tokenizer)
    reset, refused = cold_start(backend) if reset_cache else (None, None)
    counters_before = backend.engine_counters()
    stop = threading.Event()
    outcomes: dict[int, RunOutcome] = {}
    pending: dict[Future[RunOutcome], int] = {}
    started = time.perf_counter()
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="kvtrace-replay")
    try:
        for index, name in enumerate(names):
            while len(pending) >= concurrency:
                _collect(pending, outcomes)
            try:
                path = steps_to_replay(store, name, mode=mode)
            except KvtraceError as exc:
                outcomes[index] = RunOutcome(name, None, 0.0, error=_one_line(exc))
                if progress is not None:
                    progress.run_finished(outcomes[index])
                continue
            job = _Job(name, path, backend, tokenizer, mode, use_drafts, progress, stop)
            pending[pool.submit(job.run)] = index
        while pending:
            _collect(pending, outcomes)
    except BaseException:
        stop.set()  # each run stops after its request in flight
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    wall_s = time.perf_counter() - started
    return RunsReport(mode, backend.name, backend.model, concurrency,
                      [outcomes[i] for i in range(len(names))], wall_s,
                      engine=backend.engine_facts,
                      engine_counters=counters_grown(counters_before, backend.engine_counters()),
                      reset=reset, notes=[refused] if refused else [])


def _collect(pending: dict[Future[RunOutcome], int], outcomes: dict[int, RunOutcome]) -> None:
    """Wait for one run at least to end, and keep what ended (a bug in a worker re-raises)."""
    done, _ = wait(pending, return_when=FIRST_COMPLETED)
    for future in done:
        outcomes[pending.pop(future)] = future.result()


class _Stopped(BaseException):
    """Raised between two steps of a run when the whole replay was interrupted."""


@dataclass(frozen=True, slots=True)
class _Job:
    """One run to replay on a worker thread."""

    name: str
    path: list[Step]
    backend: Backend
    tokenizer: Tokenizer | None
    mode: ReplayMode
    use_drafts: bool
    progress: RunsProgress | None
    stop: threading.Event

    def run(self) -> RunOutcome:
        calls = [step for step in self.path if step.kind == StepKind.MODEL_CALL]
        num_done = 0

        def on_step(done: int, total: int, step: StepReport) -> None:
            nonlocal num_done
            num_done = done
            if self.progress is not None:
                self.progress.step_done(self.name, done, total, step)
            if self.stop.is_set():
                raise _Stopped

        if self.progress is not None:
            self.progress.run_started(self.name, len(calls))
        started = time.perf_counter()
        try:
            report = replay_steps(self.name, self.path, self.backend, mode=self.mode,
                                  use_drafts=self.use_drafts, on_step=on_step,
                                  tokenizer=self.tokenizer, count_engine=False)
            outcome = RunOutcome(self.name, report, report.wall_s)
            if report.stopped is not None:  # past the model's context: failed there
                outcome = RunOutcome(self.name, None, report.wall_s,
                                     error=report.stopped.line(),
                                     failed_at=report.stopped.depth,
                                     num_done=len(report.steps))
        except KvtraceError as exc:
            failed = calls[num_done] if num_done < len(calls) else None
            outcome = RunOutcome(self.name, None, time.perf_counter() - started,
                                 error=_one_line(exc),
                                 failed_at=failed.depth if failed is not None else None,
                                 num_done=num_done)
        if self.progress is not None:
            self.progress.run_finished(outcome)
        return outcome


class _SharedTokenizer:
    """A tokenizer that several threads may call: one call at a time (module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self.max_context_tokens = getattr(tokenizer, "max_context_tokens", None)

    @property
    def eos_token_ids(self) -> Sequence[int]:
        return self._tokenizer.eos_token_ids

    def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        with self._lock:
            return self._tokenizer.chat_tokens(
                messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def is_glob(name: str) -> bool:
    """Whether `name` is a glob over run names (run names cannot hold `* ? [`)."""
    return any(character in name for character in GLOB_CHARACTERS)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
