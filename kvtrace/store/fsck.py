"""fsck: re-hash everything and check every reference.

Checks: each step's body is canonical, well formed, hashes to its id and
agrees with its columns (parent, kind, depth, skip pointer); each parent and
payload blob exists; each blob hashes to its address and has its recorded size,
and a blob read as JSON is canonical JSON; each ref, reflog entry and note
points at an existing step; each ref's head is the new head of its last
reflog entry, and each ref in the reflog still exists (refs are the one
mutable table, so a move or a deletion behind kvtrace's back shows up here,
and `Store.reset(name)` repairs it); every stored time is a sane timestamp.
It streams rows and never writes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.errors import IntegrityError, UsageError
from kvtrace.store import bodies, codec, lists
from kvtrace.store.encoding import decode_body, decode_json_blob
from kvtrace.store.history import ancestor_in_memory, skip_in_memory
from kvtrace.store.records import FsckReport
from kvtrace.store.schema import blobs, notes, reflog, refs, steps
from kvtrace.store.validation import timestamp_problem

_BATCH = 1000


def check(conn: Connection) -> FsckReport:
    """Return a report whose `problems` list is empty on a sound store."""
    problems: list[str] = []
    stream = conn.execution_options(yield_per=_BATCH)
    rows: dict[str, tuple[str | None, int, str | None, int | None]] = {}
    wanted: dict[str, str] = {}  # blob address -> "json" or "raw"
    payloads: dict[str, dict[str, str]] = {}
    list_entries: dict[str, dict[str, Any]] = {}
    for row in stream.execute(sa.select(steps)):
        rows[row.id] = (row.parent_id, row.depth, row.skip_id, row.skip_depth)
        _check_time(f"step {row.id[:12]}: recorded_at", row.recorded_at, problems)
        value = _check_body(row, problems)
        if value is not None:
            payloads[row.id] = dict(value["payload"])
            for key, address in value["payload"].items():
                wanted.setdefault(address, "raw" if key in value["raw"] else "json")
            list_entries[row.id] = lists.lists_of(value)
            for key, entry in list_entries[row.id].items():
                for index, address in enumerate(entry["items"]):
                    payloads[row.id][f"{key}[{index}]"] = address
                    wanted.setdefault(address, "json")
    problems.extend(_check_lists(list_entries, rows))
    problems.extend(_check_history(rows))

    blob_ids: set[str] = set()
    for address, size, kept_as, data in stream.execute(
        sa.select(blobs.c.hash, blobs.c.size, blobs.c.codec, blobs.c.data)
    ):
        blob_ids.add(address)
        try:
            content = codec.decode(bytes(data), kept_as, size)
        except IntegrityError as exc:
            problems.append(f"blob {address[:12]}: {exc}")
            continue
        problems.extend(_check_blob(address, size, content, wanted.get(address)))
    for step_id, payload in payloads.items():
        for key, address in payload.items():
            if address not in blob_ids:
                problems.append(f"step {step_id[:12]}: blob {address[:12]} ({key}) is missing")

    ref_heads: dict[str, str | None] = {}
    for name, head, created_at in conn.execute(
        sa.select(refs.c.name, refs.c.head, refs.c.created_at)
    ):
        ref_heads[name] = head
        _check_time(f"run {name!r}: created_at", created_at, problems)
        if head is not None and head not in rows:
            problems.append(f"run {name!r}: head {head[:12]} is missing")
    logged_heads: dict[str, str | None] = {}
    for entry_id, ref, old, new, created_at in stream.execute(
        sa.select(
            reflog.c.id, reflog.c.ref, reflog.c.old_head, reflog.c.new_head, reflog.c.created_at
        ).order_by(reflog.c.id)
    ):
        logged_heads[ref] = new
        _check_time(f"reflog entry {entry_id}: created_at", created_at, problems)
        for head in (old, new):
            if head is not None and head not in rows:
                problems.append(f"reflog entry {entry_id}: step {head[:12]} is missing")
    problems.extend(_check_refs(ref_heads, logged_heads))
    num_notes = 0
    for note_id, step_id, created_at in stream.execute(
        sa.select(notes.c.id, notes.c.step_id, notes.c.created_at)
    ):
        num_notes += 1
        _check_time(f"note {note_id}: created_at", created_at, problems)
        if step_id not in rows:
            problems.append(f"note {note_id}: step {step_id[:12]} is missing")
    return FsckReport(len(blob_ids), len(rows), len(ref_heads), num_notes, problems)


def _check_time(label: str, value: Any, problems: list[str]) -> None:
    problem = timestamp_problem(value)
    if problem:
        problems.append(f"{label} {problem}")


def _check_refs(
    ref_heads: dict[str, str | None], logged_heads: dict[str, str | None]
) -> list[str]:
    """Each ref where its reflog last put it; each logged ref still there."""
    problems = []
    for name, head in sorted(ref_heads.items()):
        if name not in logged_heads:
            problems.append(f"run {name!r} has no reflog: it was created behind kvtrace's back")
        elif logged_heads[name] != head:
            logged = str(logged_heads[name])[:12]
            problems.append(
                f"run {name!r}: head {str(head)[:12]} is not {logged}, where its reflog last "
                f"moved it (moved behind kvtrace's back; `kvtrace reset {name}` puts it back)"
            )
    for name, head in sorted(logged_heads.items()):
        if name not in ref_heads:
            problems.append(
                f"run {name!r} is missing but its reflog ends at {str(head)[:12]} (deleted "
                f"behind kvtrace's back; `kvtrace reset {name}` restores it)"
            )
    return problems


def _check_lists(
    list_entries: dict[str, dict[str, Any]],
    rows: dict[str, tuple[str | None, int, str | None, int | None]],
) -> list[str]:
    """Every list builds on a strict ancestor that has the list, in a chain short enough."""
    problems: list[str] = []

    def lookup(step_id: str) -> tuple[str | None, int, str | None]:
        parent, depth, skip_id, _ = rows[step_id]
        return parent, depth, skip_id

    for step_id, entries in list_entries.items():
        parent, depth = rows[step_id][0], rows[step_id][1]
        for field, entry in entries.items():
            base = entry["base"]
            if base is None:
                continue
            try:
                is_ancestor = base in rows and parent is not None and rows[base][1] < depth and (
                    ancestor_in_memory(parent, rows[base][1], lookup) == base)
            except KeyError:  # a broken parent chain, reported by _check_history
                continue
            if not is_ancestor:
                problems.append(f"step {step_id[:12]}: list {field!r} builds on "
                                f"{base[:12]}, which is not one of its ancestors")
    resolved: dict[lists.ListKey, lists.Resolved] = {}

    def fetch(ids: list[str]) -> dict[str, dict[str, Any]]:
        return {i: list_entries[i] for i in ids if i in list_entries}

    for step_id, entries in list_entries.items():
        for field in entries:
            try:
                lists.resolve(fetch, [(step_id, field)], resolved)
            except IntegrityError as exc:
                problems.append(f"step {step_id[:12]}: list {field!r}: {exc}")
    return problems


def _check_body(row: Any, problems: list[str]) -> dict[str, Any] | None:
    label = f"step {row.id[:12]}"
    try:
        body = bodies.decode(row.body, row.body_codec)
    except IntegrityError as exc:
        problems.append(f"{label}: body kept as {row.body_codec!r} does not decode (tampered): "
                        f"{exc}")
        return None
    if hashlib.sha256(body).hexdigest() != row.id:
        problems.append(f"{label}: body does not hash to its id (tampered)")
        return None
    try:
        value = decode_body(body)
    except (IntegrityError, UsageError) as exc:  # UsageError: nested past the limit
        problems.append(f"{label}: {exc}")
        return None
    if value["parent"] != row.parent_id or value["kind"] != row.kind:
        problems.append(f"{label}: parent or kind column disagrees with the hashed body")
    return value


def _check_history(rows: dict[str, tuple[str | None, int, str | None, int | None]]) -> list[str]:
    """Parents exist, depths count from the root, skip pointers point where they must."""
    problems = []
    expected: dict[str, tuple[str | None, int, str | None]] = {}
    for step_id, (parent, depth, skip_id, skip_depth) in sorted(
        rows.items(), key=lambda item: item[1][1]
    ):
        label = f"step {step_id[:12]}"
        if parent is None:
            if depth != 1:
                problems.append(f"{label}: root step has depth {depth}, not 1")
        elif parent not in rows:
            problems.append(f"{label}: parent {parent[:12]} is missing")
            continue
        elif depth != rows[parent][1] + 1:
            problems.append(f"{label}: depth {depth} is not its parent's depth + 1")
            continue
        try:
            want = skip_in_memory(parent, depth, expected.__getitem__)
        except (KeyError, IntegrityError):
            continue  # an ancestor is already reported
        if want != (skip_id, skip_depth):
            problems.append(f"{label}: skip pointer is wrong")
        expected[step_id] = (parent, depth, want[0])
    return problems


def _check_blob(address: str, size: int, data: bytes, use: str | None) -> list[str]:
    label = f"blob {address[:12]}"
    if hashlib.sha256(data).hexdigest() != address:
        return [f"{label}: content does not hash to its address"]
    if len(data) != size:
        return [f"{label}: size {len(data)} != recorded {size}"]
    if use == "json":
        try:
            decode_json_blob(data)
        except (IntegrityError, UsageError) as exc:  # UsageError: nested past the limit
            return [f"{label}: {exc}"]
    return []
