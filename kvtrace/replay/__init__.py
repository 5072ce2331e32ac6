"""Replay recorded runs through a model, reusing the KV cache of every matching prefix.

`replay()` walks a run from the root to a step in verify or rebuild mode and
reports reuse against the oracle bound; `checkout()` rebuilds a step's KV so
that `continue_run()` starts warm; `analyze()` finds prefix breakers with the
tokenizer alone. Backends: `LocalBackend` (the engine and its two-tier
cache) and `RemoteBackend` (any OpenAI-compatible server).
"""

from __future__ import annotations

from kvtrace.replay.analyze import Analysis, PrefixBreaker, analyze
from kvtrace.replay.backend import Backend, SamplingParams
from kvtrace.replay.branch import BranchReport, branch_out
from kvtrace.replay.continuation import ContinueResult, continue_run
from kvtrace.replay.driver import checkout, replay
from kvtrace.replay.local import LocalBackend, open_local_backend
from kvtrace.replay.remote import RemoteBackend
from kvtrace.replay.report import ReplayReport, StepReport

__all__ = [
    "Analysis",
    "Backend",
    "BranchReport",
    "ContinueResult",
    "LocalBackend",
    "PrefixBreaker",
    "RemoteBackend",
    "ReplayReport",
    "SamplingParams",
    "StepReport",
    "analyze",
    "branch_out",
    "checkout",
    "continue_run",
    "open_local_backend",
    "replay",
]
