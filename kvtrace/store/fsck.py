"""fsck: re-hash everything and check every reference.

Checks: each blob hashes to its address and has its recorded size; each step's
body is canonical, hashes to its id, agrees with its columns (parent, kind,
depth) and names blobs that exist; each parent exists; each ref, reflog entry
and note points at an existing step. It reads in batches and never writes.
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.errors import IntegrityError
from kvtrace.store.encoding import decode_body
from kvtrace.store.records import FsckReport
from kvtrace.store.schema import blobs, notes, reflog, refs, steps


def check(conn: Connection) -> FsckReport:
    """Return a report whose `problems` list is empty on a sound store."""
    problems: list[str] = []
    num_blobs = 0
    blob_ids: set[str] = set()
    for address, size, data in conn.execute(sa.select(blobs.c.hash, blobs.c.size, blobs.c.data)):
        num_blobs += 1
        blob_ids.add(address)
        data = bytes(data)
        if hashlib.sha256(data).hexdigest() != address:
            problems.append(f"blob {address[:12]}: content does not hash to its address")
        elif len(data) != size:
            problems.append(f"blob {address[:12]}: size {len(data)} != recorded {size}")

    depths = dict(conn.execute(sa.select(steps.c.id, steps.c.depth)).all())
    num_steps = 0
    for row in conn.execute(sa.select(steps)):
        num_steps += 1
        problems.extend(_check_step(row, depths, blob_ids))

    num_refs = 0
    for name, head in conn.execute(sa.select(refs.c.name, refs.c.head)):
        num_refs += 1
        if head is not None and head not in depths:
            problems.append(f"run {name!r}: head {head[:12]} is missing")
    for entry_id, old, new in conn.execute(
        sa.select(reflog.c.id, reflog.c.old_head, reflog.c.new_head)
    ):
        for head in (old, new):
            if head is not None and head not in depths:
                problems.append(f"reflog entry {entry_id}: step {head[:12]} is missing")
    num_notes = 0
    for note_id, step_id in conn.execute(sa.select(notes.c.id, notes.c.step_id)):
        num_notes += 1
        if step_id not in depths:
            problems.append(f"note {note_id}: step {step_id[:12]} is missing")
    return FsckReport(num_blobs, num_steps, num_refs, num_notes, problems)


def _check_step(row: sa.Row, depths: dict[str, int], blob_ids: set[str]) -> list[str]:
    label = f"step {row.id[:12]}"
    body = bytes(row.body)
    if hashlib.sha256(body).hexdigest() != row.id:
        return [f"{label}: body does not hash to its id (tampered)"]
    try:
        value = decode_body(body)
    except IntegrityError as exc:
        return [f"{label}: {exc}"]
    problems = []
    if value["parent"] != row.parent_id or value["kind"] != row.kind:
        problems.append(f"{label}: parent or kind column disagrees with the hashed body")
    if row.parent_id is None:
        if row.depth != 1:
            problems.append(f"{label}: root step has depth {row.depth}, not 1")
    elif row.parent_id not in depths:
        problems.append(f"{label}: parent {row.parent_id[:12]} is missing")
    elif row.depth != depths[row.parent_id] + 1:
        problems.append(f"{label}: depth {row.depth} is not its parent's depth + 1")
    for key, address in value["payload"].items():
        if address not in blob_ids:
            problems.append(f"{label}: blob {address[:12]} ({key}) is missing")
    return problems
