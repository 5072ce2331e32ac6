"""Replays started from the UI: one background thread each, their progress readable any time.

A `ReplayJob` calls `kvtrace.replay.replay` (the same call `kvtrace replay`
makes) on a worker thread, with an `on_step` callback that appends each
model call's `StepReport`; a page follows it through `snapshot()` (the
steps so far, done/total, the state), which an SSE stream sends as it
changes. Jobs run one at a time (`Jobs` holds a lock): the engine is one
model on a few cores, and two replays at once would only slow both. The
backend is loaded on the first replay (a model load takes seconds) and kept.
The last finished report of each run is kept too: a step page shows the
tokens that replay computed for it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvtrace.errors import KvtraceError, UsageError
from kvtrace.replay import Backend, ReplayMode, ReplayReport, StepReport, replay
from kvtrace.replay.driver import steps_to_replay
from kvtrace.store import Store
from kvtrace.store.kinds import StepKind


class JobState(StrEnum):
    WAITING = "waiting"  # another replay holds the engine
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass
class ReplayJob:
    """One replay of `run` in `mode`, its progress as it goes."""

    id: int
    run: str
    mode: ReplayMode
    total: int
    state: JobState = JobState.WAITING
    steps: list[StepReport] = field(default_factory=list)
    report: ReplayReport | None = None
    error: str | None = None
    changed: threading.Condition = field(default_factory=threading.Condition)

    def snapshot(self) -> dict[str, Any]:
        """What a page shows: state, done/total, each model call's hit and oracle bound."""
        with self.changed:
            steps = list(self.steps)
            state, error = self.state, self.error
        hit = None
        if self.report is not None:
            hit = self.report.total.hit_rate
        return {
            "id": self.id, "run": self.run, "mode": str(self.mode), "state": str(state),
            "done": len(steps), "total": self.total, "error": error, "hit_rate": hit,
            "steps": [{"depth": s.depth, "prompt_tokens": s.prompt_tokens,
                       "reused_tokens": s.reused_tokens, "computed_tokens": s.computed_tokens,
                       "oracle_tokens": s.oracle_tokens, "is_match": s.is_match}
                      for s in steps],
        }

    def wait_change(self, seen: int, timeout: float) -> None:
        """Block until more steps than `seen` are reported, the job ends, or `timeout`."""
        with self.changed:
            self.changed.wait_for(lambda: len(self.steps) > seen or self.is_over, timeout)

    @property
    def is_over(self) -> bool:
        return self.state in (JobState.DONE, JobState.FAILED)


class Jobs:
    """The replays of one UI server, run one at a time on worker threads."""

    def __init__(self, store: Store, load_backend: Callable[[], Backend] | None) -> None:
        self._store = store
        self._load_backend = load_backend
        self._backend: Backend | None = None
        self._engine_lock = threading.Lock()
        self._jobs: dict[int, ReplayJob] = {}
        self._ids = itertools.count(1)
        self._last: dict[str, ReplayReport] = {}

    def start(self, run: str, mode: ReplayMode | str) -> ReplayJob:
        """Check the replay (cheap, no model), then run it in the background."""
        if self._load_backend is None:
            raise UsageError("this kvtrace ui was started without a replay backend "
                             "(--no-replay): restart it without that flag to replay")
        path = steps_to_replay(self._store, run, mode=mode)
        total = sum(1 for step in path if step.kind == StepKind.MODEL_CALL)
        job = ReplayJob(next(self._ids), run, ReplayMode(mode), total)
        self._jobs[job.id] = job
        threading.Thread(target=self._run, args=(job, self._load_backend), daemon=True,
                         name=f"kvtrace-ui-replay-{job.id}").start()
        return job

    def get(self, job_id: int) -> ReplayJob | None:
        return self._jobs.get(job_id)

    def last_step_report(self, step_id: str) -> tuple[str, StepReport] | None:
        """(run, report) of the latest finished replay that replayed step `step_id`."""
        for run, report in reversed(self._last.items()):
            for step in report.steps:
                if step.step_id == step_id:
                    return run, step
        return None

    def _run(self, job: ReplayJob, load_backend: Callable[[], Backend]) -> None:
        def on_step(_done: int, _total: int, step: StepReport) -> None:
            with job.changed:
                job.steps.append(step)
                job.changed.notify_all()

        with self._engine_lock:
            with job.changed:
                job.state = JobState.RUNNING
                job.changed.notify_all()
            try:
                if self._backend is None:
                    self._backend = load_backend()
                report = replay(self._store, job.run, self._backend, mode=job.mode,
                                on_step=on_step)
            except KvtraceError as exc:
                self._end(job, JobState.FAILED, error=str(exc))
                return
            except Exception as exc:  # shown on the page, not lost on a thread
                self._end(job, JobState.FAILED, error=f"{type(exc).__name__}: {exc}")
                return
            self._last.pop(job.run, None)
            self._last[job.run] = report
            if report.stopped is not None:  # past the model's context: the steps before it
                self._end(job, JobState.FAILED, error=report.stopped.line(), report=report)
                return
            self._end(job, JobState.DONE, report=report)

    @staticmethod
    def _end(job: ReplayJob, state: JobState, *, error: str | None = None,
             report: ReplayReport | None = None) -> None:
        with job.changed:
            job.state, job.error, job.report = state, error, report
            job.changed.notify_all()
