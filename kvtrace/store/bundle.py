"""Bundles: a run with its steps, blobs and notes in one portable file.

Format (JSON Lines, UTF-8): a header line
``{"format": "kvtrace-bundle", "version": 1, "run": NAME, "head": ID}``, then
one line per blob ``{"blob": ADDRESS, "data": BASE64}``, per step
``{"step": ID, "body": BODY, "recorded_at": T}`` (root first) and per note.
Import recomputes every address and id before writing anything, so a modified
bundle is refused whole; identical content lands under identical ids.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import IO, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.errors import ConflictError, IntegrityError, UsageError
from kvtrace.store.backend import insert_ignore
from kvtrace.store.encoding import decode_body
from kvtrace.store.names import validate_run_name
from kvtrace.store.records import RunInfo
from kvtrace.store.refs import create_ref
from kvtrace.store.schema import blobs, notes, refs, steps

FORMAT = "kvtrace-bundle"
VERSION = 1


def _line(file: IO[bytes], value: dict[str, Any]) -> None:
    file.write(json.dumps(value, ensure_ascii=False, sort_keys=True).encode("utf-8") + b"\n")


def write_bundle(
    conn: Connection, file: IO[bytes], name: str, head: str | None, chain: list[str]
) -> int:
    """Write the steps `chain` (root first) of run `name`; return the number of steps."""
    _line(file, {"format": FORMAT, "version": VERSION, "run": name, "head": head})
    rows = {r.id: r for r in conn.execute(sa.select(steps).where(steps.c.id.in_(chain)))}
    written: set[str] = set()
    for step_id in chain:
        row = rows[step_id]
        body = bytes(row.body)
        for address in json.loads(body)["payload"].values():
            if address in written:
                continue
            data = conn.execute(sa.select(blobs.c.data).where(blobs.c.hash == address)).scalar()
            if data is None:
                raise IntegrityError(f"blob {address[:12]} is missing: run `kvtrace fsck`")
            _line(file, {"blob": address, "data": base64.b64encode(bytes(data)).decode()})
            written.add(address)
        _line(file, {"step": step_id, "body": body.decode("utf-8"), "recorded_at": row.recorded_at})
    for note in conn.execute(
        sa.select(notes).where(notes.c.step_id.in_(chain)).order_by(notes.c.id)
    ):
        _line(
            file,
            {
                "note": note.step_id,
                "author": note.author,
                "text": note.text,
                "created_at": note.created_at,
            },
        )
    return len(chain)


def read_bundle(conn: Connection, file: IO[bytes], name: str | None) -> RunInfo:
    """Verify and import a bundle in the caller's transaction."""
    header, blob_rows, step_rows, note_rows = _parse(file)
    run = validate_run_name(name or header["run"])
    head = header["head"]
    known = {r.id: r.depth for r in step_rows}
    for row in step_rows:  # root first: parents come before children
        parent = row["parent_id"]
        if parent is None:
            row["depth"] = 1
        else:
            parent_depth = known.get(parent)
            if parent_depth is None:
                parent_depth = conn.execute(
                    sa.select(steps.c.depth).where(steps.c.id == parent)
                ).scalar()
            if parent_depth is None:
                raise IntegrityError(f"bundle step {row['id'][:12]} has a parent that is nowhere")
            row["depth"] = parent_depth + 1
        known[row["id"]] = row["depth"]
    if head is not None and head not in known:
        raise IntegrityError("bundle head is not among its steps")
    existing = conn.execute(sa.select(refs.c.head).where(refs.c.name == run)).first()
    insert_ignore(conn, blobs, blob_rows, "hash")
    insert_ignore(conn, steps, step_rows, "id")
    for note in note_rows:
        if note["step_id"] not in known:
            raise IntegrityError("bundle note is attached to a step outside the bundle")
        duplicate = conn.execute(
            sa.select(notes.c.id).where(
                notes.c.step_id == note["step_id"],
                notes.c.text == note["text"],
                notes.c.created_at == note["created_at"],
            )
        ).first()
        if duplicate is None:
            conn.execute(sa.insert(notes).values(**note))
    if existing is None:
        create_ref(conn, run, head, reason="import", message="import bundle")
    elif existing.head != head:
        raise ConflictError(
            f"run {run!r} exists with another head: import under a new name (--as NAME)"
        )
    return RunInfo(run, head, known.get(head, 0) if head else 0, 0.0)


class _StepRow(dict[str, Any]):
    @property
    def id(self) -> str:
        return str(self["id"])

    @property
    def depth(self) -> int:
        return int(self["depth"])


def _parse(
    file: IO[bytes],
) -> tuple[dict[str, Any], list[dict[str, Any]], list[_StepRow], list[dict[str, Any]]]:
    try:
        lines = [json.loads(line) for line in file.read().decode("utf-8").splitlines() if line]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"not a kvtrace bundle: {exc}") from exc
    if not lines or lines[0].get("format") != FORMAT or lines[0].get("version") != VERSION:
        raise UsageError("not a kvtrace bundle (bad or missing header line)")
    header, blob_rows, step_rows, note_rows = lines[0], [], [], []
    addresses: set[str] = set()
    for item in lines[1:]:
        if "blob" in item:
            data = base64.b64decode(item["data"])
            if hashlib.sha256(data).hexdigest() != item["blob"]:
                raise IntegrityError(f"bundle blob {item['blob'][:12]} does not match its hash")
            addresses.add(item["blob"])
            blob_rows.append({"hash": item["blob"], "size": len(data), "data": data})
        elif "step" in item:
            body = item["body"].encode("utf-8")
            if hashlib.sha256(body).hexdigest() != item["step"]:
                raise IntegrityError(f"bundle step {item['step'][:12]} does not match its id")
            value = decode_body(body)
            missing = set(value["payload"].values()) - addresses
            if missing:
                raise IntegrityError(f"bundle step {item['step'][:12]} refers to a missing blob")
            step_rows.append(
                _StepRow(
                    id=item["step"],
                    parent_id=value["parent"],
                    kind=value["kind"],
                    depth=0,
                    body=body,
                    recorded_at=float(item["recorded_at"]),
                )
            )
        elif "note" in item:
            note_rows.append(
                {
                    "step_id": item["note"],
                    "author": item.get("author"),
                    "text": item["text"],
                    "created_at": float(item["created_at"]),
                }
            )
        else:
            raise UsageError("not a kvtrace bundle: unknown line")
    return header, blob_rows, step_rows, note_rows
