"""A run: a named branch that a writer appends steps to.

A `Run` remembers the head it last saw. Each record call appends a step after
that head and moves the ref by compare-and-swap; if another writer moved the
run in between, the call raises ConflictError and nothing is written, so no
step is ever silently lost. `refresh()` re-reads the head to go on from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtrace.errors import UsageError

if TYPE_CHECKING:
    from kvtrace.store.records import Step
    from kvtrace.store.store import Store


class Run:
    """A writer on one run of a store."""

    def __init__(self, store: Store, name: str, head: Step | None) -> None:
        self.store = store
        self.name = name
        self._head = head

    def __repr__(self) -> str:
        head = self._head.short_id if self._head else None
        return f"Run({self.name!r}, head={head})"

    @property
    def head(self) -> Step | None:
        """The head this writer last saw (None for an empty run)."""
        return self._head

    def refresh(self) -> Step | None:
        """Re-read the head from the store (after a conflict, say)."""
        self._head = self.store.head(self.name)
        return self._head

    def record(
        self,
        kind: str,
        payload: Mapping[str, Any],
        *,
        meta: Mapping[str, Any] | None = None,
        raw: Mapping[str, bytes] | None = None,
    ) -> Step:
        """Append a step of any kind: JSON `payload` fields, raw-bytes `raw` fields."""
        step = self.store.append(self.name, self._head, kind, payload, meta or {}, raw)
        self._head = step
        return step

    def record_model_call(
        self,
        messages: list[dict[str, Any]],
        response: Any,
        *,
        model: str,
        params: Mapping[str, Any] | None = None,
        usage: Mapping[str, Any] | None = None,
        timings: Mapping[str, Any] | None = None,
    ) -> Step:
        """Record one model call: the chat messages sent and the response received.

        `response` is the assistant message (a dict with `role` and `content`,
        maybe `tool_calls`) or a plain string, which is stored as such.
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise UsageError("messages must be a list of dicts (OpenAI chat format)")
        if not model:
            raise UsageError("model must name the model that answered")
        meta = {
            "model": model,
            "params": dict(params) if params else None,
            "usage": dict(usage) if usage else None,
            "timings": dict(timings) if timings else None,
        }
        return self.record("model_call", {"messages": messages, "response": response}, meta=meta)

    def record_tool_call(
        self, name: str, arguments: Any, result: Any, *, error: str | None = None
    ) -> Step:
        """Record one tool call with its arguments and result (or error)."""
        if not name:
            raise UsageError("a tool call needs the tool's name")
        return self.record(
            "tool_call",
            {"arguments": arguments, "result": result},
            meta={"tool": name, "error": error},
        )

    def record_note(self, text: str, *, author: str | None = None) -> Step:
        """Record a note as a step of the run (unlike Store.note, which annotates a step)."""
        return self.record("note", {"text": text}, meta={"author": author})
