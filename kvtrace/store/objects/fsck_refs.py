"""fsck of refs, the reflog and notes: each checked in SQL, one streamed query each.

Each ref, reflog entry and note points at an existing step; each ref's head
is the new head of its last reflog entry, and each ref in the reflog still
exists (refs are the one mutable table, so a move or a deletion behind
kvtrace's back shows up here, and `Store.reset(name)` repairs it); every
stored time is a sane timestamp. Whether a step exists is an `EXISTS` on the
steps' primary key and a ref's last reflog entry comes from `ix_reflog_ref`,
so nothing is held in memory per step, ref or entry.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.store.db.schema import notes, reflog, refs, steps
from kvtrace.store.validation import timestamp_problem

_PAGE = 1000  # rows streamed at a time


def check_refs(conn: Connection, problems: list[str]) -> int:
    """Check every ref and reflog entry; return how many refs there are."""
    stream = conn.execution_options(yield_per=_PAGE)
    num_refs = 0
    heads = sa.select(refs.c.name, refs.c.head, refs.c.created_at, _has_step(refs.c.head),
                      _last_entry(refs.c.name, reflog.c.id),
                      _last_entry(refs.c.name, reflog.c.new_head)).order_by(refs.c.name)
    for name, head, created_at, has_head, last_id, logged in stream.execute(heads):
        num_refs += 1
        check_time(f"run {name!r}: created_at", created_at, problems)
        if head is not None and not has_head:
            problems.append(f"run {name!r}: head {head[:12]} is missing")
        if last_id is None:
            problems.append(f"run {name!r} has no reflog: it was created behind kvtrace's back")
        elif logged != head:
            problems.append(
                f"run {name!r}: head {str(head)[:12]} is not {str(logged)[:12]}, where its "
                f"reflog last moved it (moved behind kvtrace's back; `kvtrace reset {name}` "
                f"puts it back)")
    logged = reflog.alias("logged")
    gone = (sa.select(logged.c.ref, _last_entry(logged.c.ref, reflog.c.new_head))
             .where(~sa.exists().where(refs.c.name == logged.c.ref))
             .group_by(logged.c.ref).order_by(logged.c.ref))
    for name, head in stream.execute(gone):
        problems.append(
            f"run {name!r} is missing but its reflog ends at {str(head)[:12]} (deleted "
            f"behind kvtrace's back; `kvtrace reset {name}` restores it)")
    entries = sa.select(reflog.c.id, reflog.c.old_head, reflog.c.new_head, reflog.c.created_at,
                      _has_step(reflog.c.old_head), _has_step(reflog.c.new_head)
                      ).order_by(reflog.c.id)
    for entry_id, old, new, created_at, has_old, has_new in stream.execute(entries):
        check_time(f"reflog entry {entry_id}: created_at", created_at, problems)
        for head, is_there in ((old, has_old), (new, has_new)):
            if head is not None and not is_there:
                problems.append(f"reflog entry {entry_id}: step {head[:12]} is missing")
    return num_refs


def check_notes(conn: Connection, problems: list[str]) -> int:
    """Check every note; return how many there are."""
    num_notes = 0
    query = sa.select(notes.c.id, notes.c.step_id, notes.c.created_at,
                      _has_step(notes.c.step_id)).order_by(notes.c.id)
    for note_id, step_id, created_at, has_step in conn.execution_options(
            yield_per=_PAGE).execute(query):
        num_notes += 1
        check_time(f"note {note_id}: created_at", created_at, problems)
        if not has_step:
            problems.append(f"note {note_id}: step {step_id[:12]} is missing")
    return num_notes


def _has_step(step_id: Any) -> Any:
    """Whether the step `step_id` (a column) exists: a probe of the primary key."""
    return sa.exists().where(steps.c.id == step_id)


def _last_entry(ref: Any, column: Any) -> Any:
    """`column` of the last reflog entry of `ref` (a column): the end of `ix_reflog_ref`."""
    return (sa.select(column).where(reflog.c.ref == ref).order_by(reflog.c.id.desc()).limit(1)
            .scalar_subquery())


def check_time(label: str, value: Any, problems: list[str]) -> None:
    """Add a problem to `problems` when `value` is not a sane timestamp."""
    problem = timestamp_problem(value)
    if problem:
        problems.append(f"{label} {problem}")
