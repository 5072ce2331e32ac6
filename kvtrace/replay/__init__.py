"""Replay recorded runs through a model, reusing the KV cache of every matching prefix.

`replay()` walks a run from the root to a step in verify or rebuild mode and
reports reuse against the oracle bound; `replay_runs()` replays many runs
with several requests in flight (`select_runs()` reads names, globs, all);
`checkout()` rebuilds a step's KV so that `continue_run()` starts warm;
`analyze()` finds prefix breakers with the tokenizer alone. Backends:
`LocalBackend` (the engine and its two-tier cache) and `RemoteBackend` (any
OpenAI-compatible server), which loads httpx on first use so that importing
this package (the CLI does, for `ReplayMode`) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtrace.engine.sampling import SamplingParams
from kvtrace.replay.analyze import Analysis, PrefixBreaker, analyze
from kvtrace.replay.backend import Backend
from kvtrace.replay.branch import BranchReport, branch_out
from kvtrace.replay.continuation import ContinueResult, continue_run
from kvtrace.replay.driver import checkout, replay
from kvtrace.replay.local import LocalBackend, open_local_backend
from kvtrace.replay.report import ReplayMode, ReplayReport, StepReport
from kvtrace.replay.retry import RetryPolicy
from kvtrace.replay.runs import RunOutcome, RunsReport, RunStatus, replay_runs, select_runs

if TYPE_CHECKING:
    from kvtrace.replay.remote import RemoteBackend


def __getattr__(name: str) -> Any:
    if name == "RemoteBackend":
        from kvtrace.replay.remote import RemoteBackend

        return RemoteBackend
    raise AttributeError(f"module 'kvtrace.replay' has no attribute {name!r}")


__all__ = [
    "Analysis",
    "Backend",
    "BranchReport",
    "ContinueResult",
    "LocalBackend",
    "PrefixBreaker",
    "RemoteBackend",
    "ReplayMode",
    "ReplayReport",
    "RetryPolicy",
    "RunOutcome",
    "RunStatus",
    "RunsReport",
    "SamplingParams",
    "StepReport",
    "analyze",
    "branch_out",
    "checkout",
    "continue_run",
    "open_local_backend",
    "replay",
    "replay_runs",
    "select_runs",
]
