"""Refs and the reflog: the only things that move, and only together.

Every change of a ref goes through `move_ref` (or `create_ref` for a new one):
a compare-and-swap on the head (old head -> new head) and, in the same
transaction, one reflog row recording old head, new head, reason and time.
A lost swap raises ConflictError and writes nothing, so two writers can never
silently lose a step. The reflog is append-only (database triggers), which is
what makes every revert and reset undoable.

A supervisor can **pause** a run: a `pause` reflog entry (head unchanged), and
until a `resume` entry follows, an append to the run raises RunPausedError.
The check runs after the swap has locked the ref's row, as a statement of its
own, so a pause committed before the append takes the lock is always seen
(PostgreSQL re-reads only the locked row when it re-checks an UPDATE's
condition, so the check cannot ride inside the swap). It reads the newest
pause or resume of the run through a partial index holding only those
entries (`ix_reflog_pauses`): one index probe, however long the run.
On PostgreSQL every reflog entry also sends ``NOTIFY kvtrace_refs`` with the
ref's name (delivered on commit), which `Store.watch` listens for instead of
polling.

A batch's appends move their run once, when the batch has done its work
(batched.py): `move_refs` swaps the head from where the batch found it to
where the appends left it, with one reflog entry (reason `batch`) for them all.

The statements an append runs are `Prepared` (backend.py): built once here,
run by the driver.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from kvtrace.errors import ConflictError, RunPausedError, UsageError
from kvtrace.store.db.backend import Prepared
from kvtrace.store.db.schema import PAUSE_CONDITION, Address, reflog, refs

REASONS = ("create", "append", "batch", "fork", "revert", "reset", "import", "pause", "resume")
NOTIFY_CHANNEL = "kvtrace_refs"

# Built once: appending a step runs these on every call, and building
# statements costs more than executing them on SQLite.
_SWAP = Prepared(
    sa.update(refs)
    .where(
        refs.c.name == sa.bindparam("ref_name", type_=sa.String),
        refs.c.head.is_not_distinct_from(sa.bindparam("old_head", type_=Address)),
    )
    .values(head=sa.bindparam("new_head", type_=Address))
)
_LOG = Prepared(sa.insert(reflog).values(
    {column: sa.bindparam(column) for column in
     ("ref", "old_head", "new_head", "reason", "message", "created_at")}).inline())
# PAUSE_CONDITION as written: SQLite uses the partial index only for a query
# that repeats its condition term for term.
_PAUSE = Prepared(sa.text(
    f"SELECT reason, message FROM reflog WHERE ref = :ref_name AND {PAUSE_CONDITION} "
    "ORDER BY id DESC LIMIT 1"))
_CREATE = Prepared(**{
    name: insert(refs)
    .values(name=sa.bindparam("ref_name"), head=sa.bindparam("head"),
            created_at=sa.bindparam("created_at"))
    .on_conflict_do_nothing(index_elements=["name"])
    .returning(refs.c.name)
    for name, insert in (("postgresql", postgresql.insert), ("sqlite", sqlite.insert))
})
_NOTIFY = Prepared(sa.text(f"SELECT pg_notify('{NOTIFY_CHANNEL}', :ref_name)"))


def create_ref(conn: Connection, name: str, head: str | None, *, reason: str, message: str) -> None:
    """Create ref `name` at `head`; ConflictError if it already exists.

    The insert itself decides (ON CONFLICT DO NOTHING), so two creators racing
    on PostgreSQL get one success and one ConflictError, never a raw error.
    """
    now = time.time()
    if _CREATE.first(conn, {"ref_name": name, "head": head, "created_at": now}) is None:
        raise ConflictError(f"run {name!r} already exists: pick another name")
    _log(conn, name, None, head, reason, message, now)


def move_ref(
    conn: Connection,
    name: str,
    old: str | None,
    new: str | None,
    *,
    reason: str,
    message: str,
) -> None:
    """Swap ref `name` from `old` to `new`, or raise ConflictError if it is not at `old`.

    An append to a paused run raises RunPausedError (a ConflictError); the
    caller's transaction then writes nothing.
    """
    _swap(conn, name, old, new, is_append=reason == "append")
    _log(conn, name, old, new, reason, message, time.time())


def move_refs(conn: Connection, name: str, first: str | None, last: str | None,
              message: str) -> None:
    """Swap ref `name` from `first` to `last` once for a batch of appends (batched.py),
    logged as one `batch` entry.

    ConflictError if the ref is not at `first`, RunPausedError if the run is paused:
    the caller's transaction then writes nothing.
    """
    _swap(conn, name, first, last, is_append=True)
    _log(conn, name, first, last, "batch", message, time.time())


def reflog_row(name: str, old: str | None, new: str | None, reason: str, message: str,
               now: float) -> dict[str, Any]:
    """The reflog row of one move of ref `name`."""
    if reason not in REASONS:
        raise ValueError(f"unknown reflog reason {reason!r}")
    return {"ref": name, "old_head": old, "new_head": new, "reason": reason,
            "message": message, "created_at": now}


def _swap(conn: Connection, name: str, old: str | None, new: str | None, *,
          is_append: bool) -> None:
    """The compare-and-swap of a ref, and for an append the paused-run check."""
    if _SWAP.execute(conn, {"ref_name": name, "old_head": old, "new_head": new}) != 1:
        current = conn.execute(sa.select(refs.c.head).where(refs.c.name == name)).scalar()
        raise ConflictError(
            f"run {name!r} moved to {str(current)[:12]} while this writer expected "
            f"{str(old)[:12]}: reload the run (Store.run) and try again"
        )
    if is_append:
        pause = pause_entry(conn, name)
        if pause is not None:
            raise RunPausedError(
                f"run {name!r} is paused ({pause}): wait for a resume (Store.resume), "
                "then reload the run and go on"
            )


def pause_entry(conn: Connection, name: str) -> str | None:
    """The message of the pause in force on run `name`, or None when it is not paused."""
    last = _PAUSE.first(conn, {"ref_name": name})
    return str(last[1]) if last is not None and last[0] == "pause" else None


def set_paused(conn: Connection, name: str, *, paused: bool, message: str) -> None:
    """Pause or resume run `name`: lock its row, read its head, log the entry.

    Locking and reading in one statement (an UPDATE onto the same head) means
    a writer appending at that moment can neither slip in between nor make
    the pause fail: it waits for the lock, then sees the pause.
    """
    head = conn.execute(
        sa.update(refs).where(refs.c.name == name).values(head=refs.c.head)
        .returning(refs.c.head)
    ).first()
    if head is None:
        raise ConflictError(f"run {name!r} disappeared while pausing it")
    if (pause_entry(conn, name) is not None) == paused:
        raise UsageError(f"run {name!r} is {'already' if paused else 'not'} paused")
    _log(conn, name, head.head, head.head, "pause" if paused else "resume", message, time.time())


def last_logged(conn: Connection, name: str) -> tuple[int, str | None] | None:
    """(id, new head) of the newest reflog entry of ref `name`, or None if it has none.

    A ref agrees with this head unless it was changed behind kvtrace's back.
    """
    row = conn.execute(
        sa.select(reflog.c.id, reflog.c.new_head)
        .where(reflog.c.ref == name)
        .order_by(reflog.c.id.desc())
        .limit(1)
    ).first()
    return (int(row.id), row.new_head) if row is not None else None


def _log(
    conn: Connection,
    name: str,
    old: str | None,
    new: str | None,
    reason: str,
    message: str,
    now: float,
) -> None:
    _LOG.execute(conn, reflog_row(name, old, new, reason, message, now))
    if conn.dialect.name == "postgresql":
        _NOTIFY.first(conn, {"ref_name": name})
