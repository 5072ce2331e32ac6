"""Watching a run: its steps and moves as they land, from any process.

A watcher follows the run's reflog, the one ordered record of everything
that happens to a ref: each entry after a cursor (the id of the last entry
seen) becomes one event, in order, none twice. Appends to one run take the
ref's row lock before their reflog entry is written, so entry ids grow in
commit order and a cursor never skips one.

Waiting for the next entry: on SQLite the watcher polls (every
`poll_interval` seconds; a read is a few microseconds on a WAL database); on
PostgreSQL it LISTENs on the channel every ref move NOTIFYs (refs.py), with
the poll interval as a fallback, so an event arrives as soon as it commits.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from kvtrace.store.db.backend import read_transaction, reader
from kvtrace.store.db.schema import reflog
from kvtrace.store.objects import history
from kvtrace.store.objects.refs import NOTIFY_CHANNEL
from kvtrace.store.records import Step

EVENT_KINDS = ("step", "moved", "pause", "resume")


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One thing that happened to a watched run.

    `kind` is "step" (a step was appended: `step` is it), "moved" (a revert,
    reset, fork, import or a batch of appends moved the head: `head` is the
    new head, None for an empty run, and `is_back` says whether it moved to
    an ancestor of the old head, as a revert does), "pause" or "resume". `cursor` is the reflog
    entry's id: pass it as `since` to resume watching after this event.
    """

    kind: str
    cursor: int
    reason: str
    message: str
    old_head: str | None
    head: str | None
    step: Step | None = None
    is_back: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "cursor": self.cursor,
            "reason": self.reason,
            "message": self.message,
            "old_head": self.old_head,
            "head": self.head,
            "step": self.step.to_dict() if self.step else None,
            "is_back": self.is_back,
        }


StepLoader = Callable[[Any, list[str]], Iterable[Step]]  # (connection, ids) -> those steps


def watch(
    engine: sa.Engine,
    name: str,
    *,
    load_steps: StepLoader,
    since: int | None,
    timeout: float | None,
    poll_interval: float,
) -> Iterator[WatchEvent]:
    """Events of run `name` after reflog entry `since` (None: from now on), the steps they
    name read by `load_steps` (the store's, with its caches).

    Ends once `timeout` seconds have passed since it started (None: never).
    """
    snapshots = reader(engine)
    deadline = None if timeout is None else time.monotonic() + timeout
    cursor = since if since is not None else _last_entry(snapshots, name)
    with _listener(engine) as wait:
        while True:
            events = _events_after(load_steps, snapshots, name, cursor)
            for event in events:
                cursor = event.cursor
                yield event
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            if not events:
                wait(poll_interval if remaining is None else min(poll_interval, remaining))


def _last_entry(engine: Any, name: str) -> int:
    with read_transaction(engine) as conn:
        last = conn.execute(sa.select(sa.func.max(reflog.c.id)).where(reflog.c.ref == name))
        return int(last.scalar() or 0)


def _events_after(load_steps: StepLoader, engine: Any, name: str,
                  cursor: int) -> list[WatchEvent]:
    with read_transaction(engine) as conn:
        rows = conn.execute(
            sa.select(reflog).where(reflog.c.ref == name, reflog.c.id > cursor)
            .order_by(reflog.c.id)
        ).all()
        if not rows:
            return []
        appended = [r.new_head for r in rows if r.reason == "append" and r.new_head]
        steps = {s.id: s for s in load_steps(conn, appended)}
        events = []
        for row in rows:
            if row.reason == "append":
                kind = "step"
            elif row.reason in ("pause", "resume"):
                kind = row.reason
            else:
                kind = "moved"
            is_back = kind == "moved" and (
                (row.new_head is None and row.old_head is not None)
                or (row.new_head is not None and row.old_head is not None
                    and history.is_ancestor(conn, row.new_head, row.old_head))
            )
            events.append(WatchEvent(kind, int(row.id), row.reason, row.message, row.old_head,
                                     row.new_head, steps.get(row.new_head) if kind == "step"
                                     else None, is_back))
        return events


@contextlib.contextmanager
def _listener(engine: sa.Engine) -> Iterator[Any]:
    """A function `wait(seconds)` that returns early when the run may have moved."""
    if engine.dialect.name != "postgresql":
        yield time.sleep
        return
    import psycopg

    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    connection = psycopg.connect(url, autocommit=True)
    try:
        connection.execute(f"LISTEN {NOTIFY_CHANNEL}")

        def wait(seconds: float) -> None:
            for _ in connection.notifies(timeout=seconds, stop_after=1):
                break

        yield wait
    finally:
        connection.close()
