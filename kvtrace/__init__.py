"""kvtrace: record agent runs in a Git-like trace store and replay them with KV reuse.

The public surface is this short list; everything else is reachable through
its subpackages (`kvtrace.store`, `kvtrace.engine`, `kvtrace.replay`).
"""

from __future__ import annotations

from kvtrace.errors import (
    ConflictError,
    IntegrityError,
    KvtraceError,
    NotFoundError,
    RetryableError,
    UsageError,
)
from kvtrace.store import FsckReport, Note, ReflogEntry, Run, RunInfo, Step, Store, open_store

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
    "Step",
    "Store",
    "UsageError",
    "__version__",
    "open_store",
]
