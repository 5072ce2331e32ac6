"""Notes on steps: text a person or a program attaches to a step, which never changes it."""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.store.db.schema import is_address_text, notes
from kvtrace.store.records import Note

_CHUNK = 500  # step ids per query of `on_steps` (bound parameters stay few)


def add(conn: Connection, step_id: str, text: str, author: str | None) -> Note:
    """Attach a note (already checked) to step `step_id`."""
    now = time.time()
    result = conn.execute(
        sa.insert(notes).values(step_id=step_id, author=author, text=text, created_at=now))
    (note_id,) = result.inserted_primary_key or (0,)
    return Note(int(note_id), step_id, text, author, now)


def of_step(conn: Connection, step_id: str) -> list[Note]:
    """The notes on one step, oldest first."""
    rows = conn.execute(
        sa.select(notes).where(notes.c.step_id == step_id).order_by(notes.c.id)).all()
    return [Note(r.id, r.step_id, r.text, r.author, r.created_at) for r in rows]


def on_steps(conn: Connection, step_ids: list[str]) -> dict[str, list[Note]]:
    """The notes on each of `step_ids`, oldest first: one query per chunk of ids, where
    `of_step` takes a query per step. A step without notes is absent."""
    found: dict[str, list[Note]] = {}
    step_ids = [i for i in step_ids if is_address_text(i)]  # others are never kept
    for start in range(0, len(step_ids), _CHUNK):
        rows = conn.execute(
            sa.select(notes).where(notes.c.step_id.in_(step_ids[start:start + _CHUNK]))
            .order_by(notes.c.id)).all()
        for r in rows:
            found.setdefault(r.step_id, []).append(
                Note(r.id, r.step_id, r.text, r.author, r.created_at))
    return found
