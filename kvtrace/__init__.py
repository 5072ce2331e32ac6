"""kvtrace: record agent runs in a Git-like trace store and replay them with KV reuse.

The public surface is this short list; everything else is reachable through
its subpackages (`kvtrace.store`, `kvtrace.engine`, `kvtrace.replay`,
`kvtrace.tracer`).
"""

from __future__ import annotations

from kvtrace.errors import (
    ConflictError,
    IntegrityError,
    KvtraceError,
    NotFoundError,
    RetryableError,
    RunPausedError,
    UsageError,
)
from kvtrace.store import FsckReport, Note, ReflogEntry, Run, RunInfo, Step, Store, open_store
from kvtrace.store.watch import WatchEvent
from kvtrace.tracer import recording, replaying, tool

__version__ = "0.1.0"

__all__ = [
    "ConflictError",
    "FsckReport",
    "IntegrityError",
    "KvtraceError",
    "NotFoundError",
    "Note",
    "ReflogEntry",
    "RetryableError",
    "Run",
    "RunInfo",
    "RunPausedError",
    "Step",
    "Store",
    "UsageError",
    "WatchEvent",
    "__version__",
    "open_store",
    "recording",
    "replaying",
    "tool",
]
