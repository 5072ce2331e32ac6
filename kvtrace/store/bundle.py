"""Bundles: a run with its steps, blobs and notes in one portable file.

Format (JSON Lines, UTF-8): a header line
``{"format": "kvtrace-bundle", "version": 1, "run": NAME, "head": ID}``, then
one line per blob ``{"blob": ADDRESS, "data": BASE64}``, per step
``{"step": ID, "body": BODY, "recorded_at": T}`` (root first) and per note
``{"note": STEP_ID, "author", "text", "created_at"}``.

A step with list fields (version-2 model calls, see lists.py) brings its
list items as blob lines too, and one whose meta names a workspace tree
brings the tree and its files (trees.py); the base steps its lists build on are its
ancestors, so they are in the bundle. Bundles of version 1 still import.

Import checks the shape of every line and recomputes every address and id
before writing anything, so a modified or malformed bundle is refused whole;
identical content lands under identical ids. Steps may come in any order:
depths and skip pointers are derived, never trusted from the file.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time
from typing import IO, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.errors import ConflictError, IntegrityError, UsageError
from kvtrace.store.db.backend import insert_ignore
from kvtrace.store.db.schema import blobs, notes, refs, steps
from kvtrace.store.names import validate_run_name
from kvtrace.store.objects import bodies, codec, history, jsontext, lists, trees
from kvtrace.store.objects.encoding import decode_body, decode_json_blob, is_address
from kvtrace.store.objects.history import chunks, skip_in_memory
from kvtrace.store.objects.refs import create_ref
from kvtrace.store.records import RunInfo
from kvtrace.store.validation import check_kind, check_note, check_timestamp

FORMAT = "kvtrace-bundle"
VERSION = 2
READABLE_VERSIONS = (1, 2)


def _line(file: IO[bytes], value: dict[str, Any]) -> None:
    file.write(json.dumps(value, ensure_ascii=False, sort_keys=True).encode("utf-8") + b"\n")


def write_bundle(
    conn: Connection, file: IO[bytes], name: str, head: str | None, chain: list[str]
) -> int:
    """Write the steps `chain` (root first) of run `name`; return the number of steps."""
    _line(file, {"format": FORMAT, "version": VERSION, "run": name, "head": head})
    written: set[str] = set()
    for part in chunks(chain):
        rows = {r.id: r for r in conn.execute(sa.select(steps).where(steps.c.id.in_(part)))}
        kept = {step_id: bodies.decode(row.body, row.body_codec) for step_id, row in rows.items()}
        needs = {step_id: _blobs_of(body) for step_id, body in kept.items()}
        _add_workspaces(conn, kept, needs)
        wanted = sorted(set().union(*needs.values()) - written)
        data = codec.read(conn, wanted)
        for step_id in part:
            row, body = rows[step_id], kept[step_id]
            for address in needs[step_id]:
                if address in written:
                    continue
                if address not in data:
                    raise IntegrityError(f"blob {address[:12]} is missing: run `kvtrace fsck`")
                blob = base64.b64encode(data[address]).decode()
                _line(file, {"blob": address, "data": blob})
                written.add(address)
            _line(
                file,
                {"step": step_id, "body": body.decode("utf-8"), "recorded_at": row.recorded_at},
            )
    for part in chunks(chain):
        for note in conn.execute(
            sa.select(notes).where(notes.c.step_id.in_(part)).order_by(notes.c.id)
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


def _check_list_bases(
    conn: Connection, step_rows: list[dict[str, Any]], lookup: Any
) -> None:
    """Every list of the bundle builds on a strict ancestor that has that list."""
    own = {row["id"]: lists.lists_of(json.loads(row["body"])) for row in step_rows}
    from_db = lists.fetch_lists(conn)

    def fetch(ids: list[str]) -> dict[str, dict[str, Any]]:
        found = {i: own[i] for i in ids if i in own}
        rest = [i for i in ids if i not in own]
        return {**found, **from_db(rest)} if rest else found

    lists.resolve(fetch, [(i, field) for i, entries in own.items() for field in entries], {})
    for step_id, entries in own.items():
        parent, depth, _ = lookup(step_id)
        for field, entry in entries.items():
            base = entry["base"]
            if base is None:
                continue
            base_depth = lookup(base)[1]
            if parent is None or base_depth >= depth or history.ancestor_in_memory(
                parent, base_depth, lookup
            ) != base:
                raise IntegrityError(
                    f"bundle step {step_id[:12]} builds its {field!r} on a step that is "
                    "not one of its ancestors"
                )


def _add_workspaces(conn: Connection, kept: dict[str, bytes],
                    needs: dict[str, list[str]]) -> None:
    """A step that names a workspace tree brings the tree and its files (trees.py)."""
    named = {step_id: trees.tree_of_body(json.loads(body)) for step_id, body in kept.items()}
    files = trees.reached(conn, [tree for tree in named.values() if tree is not None])
    for step_id, tree in named.items():
        if tree is not None:  # a tree that is gone is reported as a missing blob
            needs[step_id] = list(dict.fromkeys([*needs[step_id], tree, *(files[tree] or [])]))


def _blobs_of(body: bytes) -> list[str]:
    """Every blob a step body names (payload fields, then its own list items), in order."""
    value = json.loads(body)
    addresses = [a for _, a in sorted(value["payload"].items())]
    for _, entry in sorted(lists.lists_of(value).items()):
        addresses += entry["items"]
    return list(dict.fromkeys(addresses))


def read_bundle(conn: Connection, file: IO[bytes], name: str | None) -> RunInfo:
    """Verify and import a bundle in the caller's transaction."""
    header, blob_rows, step_rows, note_rows = _parse(file)
    run = validate_run_name(name or header["run"])
    head = header["head"]
    by_id = {row["id"]: row for row in step_rows}
    derived: dict[str, tuple[str | None, int, str | None]] = {}

    def lookup(step_id: str) -> tuple[str | None, int, str | None]:
        if step_id not in derived:
            row = conn.execute(
                sa.select(steps.c.parent_id, steps.c.depth, steps.c.skip_id).where(
                    steps.c.id == step_id
                )
            ).first()
            if row is None:
                raise IntegrityError(f"bundle refers to step {step_id[:12]}, which is nowhere")
            derived[step_id] = (row.parent_id, row.depth, row.skip_id)
        return derived[step_id]

    for row in step_rows:
        pending: list[str] = []
        current: str | None = row["id"]
        while current is not None and current in by_id and current not in derived:
            if current in pending:
                raise IntegrityError("bundle steps form a cycle")
            pending.append(current)
            current = by_id[current]["parent_id"]
        for step_id in reversed(pending):  # root-most first
            item = by_id[step_id]
            parent = item["parent_id"]
            depth = 1 if parent is None else lookup(parent)[1] + 1
            skip_id, skip_depth = skip_in_memory(parent, depth, lookup)
            item.update(depth=depth, skip_id=skip_id, skip_depth=skip_depth)
            derived[step_id] = (parent, depth, skip_id)
    if head is not None and head not in by_id:
        raise IntegrityError("bundle head is not among its steps")
    _check_list_bases(conn, step_rows, lookup)
    for note in note_rows:
        if note["step_id"] not in by_id:
            raise IntegrityError("bundle note is attached to a step outside the bundle")

    existing = conn.execute(sa.select(refs.c.head).where(refs.c.name == run)).first()
    if existing is not None and existing.head != head:
        raise ConflictError(
            f"run {run!r} exists with another head: import it under a new name (name=NAME)",
            param="name",
        )
    # Key order, as in Store.append: concurrent writers never wait on each other in a cycle.
    insert_ignore(conn, blobs, [codec.row(row["hash"], row["data"])
                                for row in sorted(blob_rows, key=lambda row: row["hash"])], "hash")
    insert_ignore(conn, steps, [
        {**row, **dict(zip(("body", "body_codec"), bodies.encode(row["body"]), strict=True))}
        for row in sorted(step_rows, key=lambda row: row["id"])], "id")
    for note in note_rows:
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
    depth = derived[head][1] if head else 0
    return RunInfo(run, head, depth, time.time())


Parsed = tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]


def _parse(file: IO[bytes]) -> Parsed:
    """Read and check every line; nothing is written until all of them pass."""
    try:
        text = file.read().decode("utf-8")
        lines = [jsontext.loads(line, f"not a kvtrace bundle: line {number}")
                 for number, line in enumerate(text.splitlines(), start=1) if line]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"not a kvtrace bundle: {exc}") from exc
    if not lines or not isinstance(lines[0], dict) or lines[0].get("format") != FORMAT:
        raise UsageError("not a kvtrace bundle (bad or missing header line)")
    header = lines[0]
    if header.get("version") not in READABLE_VERSIONS:
        raise UsageError(f"unsupported bundle version {header.get('version')!r}")
    if not isinstance(header.get("run"), str) or not (
        "head" in header and (header["head"] is None or is_address(header["head"]))
    ):
        raise UsageError("malformed bundle header: needs a run name and a head step id")
    blob_rows: dict[str, dict[str, Any]] = {}
    step_rows: dict[str, dict[str, Any]] = {}
    note_rows: list[dict[str, Any]] = []
    json_fields: set[str] = set()
    for number, item in enumerate(lines[1:], start=2):
        try:
            _parse_line(item, blob_rows, step_rows, note_rows, json_fields)
        except (KeyError, TypeError, ValueError, AttributeError, binascii.Error) as exc:
            raise UsageError(f"malformed bundle line {number}: {exc!r}") from exc
    for row in step_rows.values():
        value = json.loads(row["body"])
        missing = {a for a in _blobs_of(row["body"]) if a not in blob_rows}
        if missing:
            raise IntegrityError(f"bundle step {row['id'][:12]} refers to a missing blob")
        for key, entry in lists.lists_of(value).items():
            if entry["base"] is not None and entry["base"] not in step_rows:
                raise IntegrityError(
                    f"bundle step {row['id'][:12]} builds its {key!r} on a step outside the bundle"
                )
            json_fields.update(entry["items"])
    for address in json_fields:
        decode_json_blob(blob_rows[address]["data"])
    return header, list(blob_rows.values()), list(step_rows.values()), note_rows


def _parse_line(
    item: Any,
    blob_rows: dict[str, dict[str, Any]],
    step_rows: dict[str, dict[str, Any]],
    note_rows: list[dict[str, Any]],
    json_fields: set[str],
) -> None:
    if not isinstance(item, dict):
        raise TypeError("a bundle line must be a JSON object")
    if "blob" in item:
        data = base64.b64decode(item["data"], validate=True)
        if hashlib.sha256(data).hexdigest() != item["blob"]:
            raise IntegrityError(f"bundle blob {str(item['blob'])[:12]} does not match its hash")
        blob_rows[item["blob"]] = {"hash": item["blob"], "size": len(data), "data": data}
    elif "step" in item:
        body = item["body"].encode("utf-8")
        if hashlib.sha256(body).hexdigest() != item["step"]:
            raise IntegrityError(f"bundle step {str(item['step'])[:12]} does not match its id")
        value = decode_body(body)
        check_kind(value["kind"])
        json_fields.update(a for k, a in value["payload"].items() if k not in value["raw"])
        step_rows[item["step"]] = {
            "id": item["step"],
            "parent_id": value["parent"],
            "kind": value["kind"],
            "depth": 0,
            "body": body,  # kept as `bodies.encode` says when inserted
            "recorded_at": check_timestamp(item["recorded_at"], "a bundle step's recorded_at"),
            "skip_id": None,
            "skip_depth": None,
        }
    elif "note" in item:
        text, author = item["text"], item.get("author")
        check_note(text, author)  # the rules of Store.note, so both backends agree
        note_rows.append(
            {
                "step_id": str(item["note"]),
                "author": author,
                "text": text,
                "created_at": check_timestamp(item["created_at"], "a bundle note's created_at"),
            }
        )
    else:
        raise ValueError("unknown line type")
