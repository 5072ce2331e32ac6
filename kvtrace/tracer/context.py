"""What is current in this context: the run being recorded, the replay session, and what a
replayed tool call gives back.

A leaf of the tracer: `recording` and `replaying` set these context
variables (so threads and asyncio tasks each see their own), and the tools
and transports read them, without importing the modules that set them.
"""

from __future__ import annotations

import builtins
import copy
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from kvtrace.errors import RecordedToolError
from kvtrace.store import Step, ToolCall

if TYPE_CHECKING:
    from kvtrace.tracer.recorder import Recorder
    from kvtrace.tracer.replay_mode import Replaying

RECORDER: ContextVar[Recorder | None] = ContextVar("kvtrace_recorder", default=None)
REPLAYING: ContextVar[Replaying | None] = ContextVar("kvtrace_replaying", default=None)


def current_recorder() -> Recorder | None:
    """The recorder of the innermost `with recording(...)` block, or None."""
    return RECORDER.get()


def current_replaying() -> Replaying | None:
    """The session of the innermost `with replaying(...)` block, or None."""
    return REPLAYING.get()


def served_outcome(step: Step) -> Any:
    """What a recorded tool call gives back: a copy of its result (its keys in the order the
    tool returned them), or its error raised."""
    call = ToolCall(step)
    if call.error is None:
        return copy.deepcopy(call.returned_result)
    type_name, _, message = call.error.partition(": ")
    kind = getattr(builtins, type_name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            error: Exception = kind(message)
        except Exception:  # a built-in whose constructor wants more (UnicodeDecodeError)
            error = RecordedToolError(type_name, message)
    else:
        error = RecordedToolError(type_name, message)
    raise error
