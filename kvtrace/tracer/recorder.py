"""Recording into a run from agent code: `recording(store, name)` and the `Recorder`.

    with kvtrace.tracer.recording(store, "main") as rec:
        rec.record_model_call(messages, response, model="gpt-4o")

        @rec.tool
        def search(query: str) -> list[str]: ...

A `Recorder` is the one writer on a run that every part of the tracer goes
through (the Python API, the httpx transports, `kvtrace serve`). It is safe
to share between threads: appends are serialised by a lock. If another
writer (another process) moved the run in between, the append re-reads the
head and goes on after it: each recorded exchange stands on its own, so
appending it after someone else's step loses nothing, and the ref still
moves only by compare-and-swap. Inside `with recording(...)`, the recorder
is also the *current* one (a context variable, so threads and asyncio tasks
each see their own), which is what `kvtrace.tool` records into.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from kvtrace.errors import ConflictError
from kvtrace.tracer.context import RECORDER
from kvtrace.tracer.tools import tool

if TYPE_CHECKING:
    from kvtrace.store import Run, Step, Store

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_CONFLICT_RETRIES = 5


class Recorder:
    """A thread-safe writer on one run (see the module docstring)."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._lock = threading.Lock()
        self.workspace: str | None = None  # the snapshot the next model calls name

    def __repr__(self) -> str:
        return f"Recorder({self._run!r})"

    @property
    def run(self) -> Run:
        return self._run

    @property
    def name(self) -> str:
        return self._run.name

    @property
    def store(self) -> Store:
        return self._run.store

    @property
    def head(self) -> Step | None:
        return self._run.head

    def append(self, write: Callable[[Run], T]) -> T:
        """Call `write(run)` under the lock; after a lost compare-and-swap, re-read and retry."""
        with self._lock:
            for _ in range(_CONFLICT_RETRIES - 1):
                try:
                    return write(self._run)
                except ConflictError:
                    self._run.refresh()
            return write(self._run)

    def record_model_call(self, messages: Any, response: Any, **fields: Any) -> Step:
        """`Run.record_model_call`, serialised (same arguments); `workspace` defaults to the
        recorder's (a recording server sets it to the snapshot taken for the request)."""
        if self.workspace is not None:
            fields.setdefault("workspace", self.workspace)
        return self.append(lambda run: run.record_model_call(messages, response, **fields))

    def record_tool_call(self, name: str, arguments: Any, result: Any, **fields: Any) -> Step:
        """`Run.record_tool_call`, serialised (same arguments)."""
        return self.append(lambda run: run.record_tool_call(name, arguments, result, **fields))

    def record_note(self, text: str, *, author: str | None = None) -> Step:
        """`Run.record_note`, serialised."""
        return self.append(lambda run: run.record_note(text, author=author))

    def record(
        self,
        kind: str,
        payload: Mapping[str, Any],
        *,
        meta: Mapping[str, Any] | None = None,
        raw: Mapping[str, bytes] | None = None,
    ) -> Step:
        """`Run.record` (a step of any kind), serialised."""
        return self.append(lambda run: run.record(kind, payload, meta=meta, raw=raw))

    def tool(self, function: F | None = None, *, name: str | None = None) -> Any:
        """Decorate a tool function so that each call is recorded here (see tools.py)."""
        return tool(function, name=name, recorder=self)


def as_recorder(run: Run | Recorder) -> Recorder:
    """A Recorder for `run` (itself when it already is one)."""
    return run if isinstance(run, Recorder) else Recorder(run)


@contextmanager
def recording(store: Store, name: str) -> Iterator[Recorder]:
    """Start or continue the run `name` and make it the current one for the block.

    The run exists once the block starts (created empty if new). Leaving the
    block, normally or by an exception, ends "current": nothing needs
    flushing, since every step is committed when it is recorded.
    """
    recorder = Recorder(store.run(name))
    token = RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        RECORDER.reset(token)
