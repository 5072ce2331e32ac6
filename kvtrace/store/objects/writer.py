"""The step writer: how a step is appended, and the caches that make an append cost what it
adds.

`Store` is the facade (as dulwich's Repo over its object store and refs
container); it hands each append here with the transaction to write in.
`StepWriter.append` encodes a step's fields (payload blobs, raw bytes, lists
item by item), stores only what is new, and moves the run's ref by
compare-and-swap (or, in a batch, leaves the move to the batch's end,
batched.py). Its caches are always right, since steps never change:

- known steps' (parent, depth, skip pointer), which saves the skip-pointer
  query on append;
- resolved list fields by (step id, field), where a model call finds the
  history it extends; bounded by entries and by the addresses they hold
  (lists.ListCache), and shared with the store's readers through
  `lists_cache`, which keeps the bound;
- recent payloads, what a new message may be stored as a delta of (deltas.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy.engine import Connection

from kvtrace.errors import UsageError
from kvtrace.store import validation
from kvtrace.store.db.backend import insert_ignore
from kvtrace.store.db.schema import blobs, steps
from kvtrace.store.objects import bodies, deltas, encoding, history
from kvtrace.store.objects import lists as store_lists
from kvtrace.store.objects.batched import BatchedMoves
from kvtrace.store.objects.refs import create_ref, move_ref
from kvtrace.store.records import Step

_MAX_KNOWN = 200_000
_MAX_LISTS = 20_000  # resolved lists kept (each a tuple of its item addresses)
_MAX_LIST_ITEMS = 1_000_000  # their item addresses, in all (8 MB of tuple slots)
_LIST_BASE_SEARCH = 16  # steps back from a new step to look for its list's base

# `write(flush=...)`: the transaction to append in (the store's, see Store._write).
Write = Callable[..., AbstractContextManager[Connection]]


class StepWriter:
    """Appends steps for a `Store` (see the module docstring)."""

    def __init__(self, write: Write, batch_moves: Callable[[], BatchedMoves | None]) -> None:
        self._write = write
        self._batch_moves = batch_moves
        self._known: dict[str, tuple[str | None, int, str | None]] = {}
        self._lists = store_lists.ListCache(max_entries=_MAX_LISTS, max_items=_MAX_LIST_ITEMS)
        self._payloads = deltas.RecentPayloads()

    def lists_cache(self) -> store_lists.ListCache:
        """The resolved-list cache, emptied first when it is full."""
        return self._lists.make_room()

    def held(self) -> dict[str, int]:
        """What the caches hold: steps known, lists resolved and their item addresses."""
        return {"known": len(self._known), "lists": len(self._lists),
                "list_items": self._lists.num_items}

    def append(
        self,
        name: str,
        parent: Step | None,
        kind: str,
        payload: Mapping[str, Any],
        meta: Mapping[str, Any],
        raw: Mapping[str, bytes] | None = None,
        lists: Mapping[str, list[Any] | store_lists.Extension] | None = None,
        *,
        new_run: str | None = None,
    ) -> Step:
        """Record a step after `parent` and move run `name` onto it, atomically.

        With `new_run` (a reflog message), run `name` is created at the new
        step instead (a fork whose head is an edited step).

        `payload` fields are JSON values stored one blob each, `raw` fields
        bytes, and `lists` fields lists stored item by item (see store/objects/lists.py),
        each given whole or as an `Extension` of an earlier step's list.
        Fails with ConflictError, writing nothing, if the run's head is no
        longer `parent` (another writer appended or moved it first).
        """
        kind = str(validation.check_kind(kind))  # a StepKind is stored as its plain value
        validation.check_record(payload, meta, raw)
        raw, list_items = raw or {}, lists or {}
        clash = (set(payload) & set(raw)) | (set(list_items) & (set(payload) | set(raw)))
        if clash:
            raise UsageError(f"payload fields given twice: {sorted(clash)}")
        data = {key: encoding.canonical_json(value) for key, value in payload.items()}
        data.update(raw)
        addresses = {key: encoding.sha256_hex(value) for key, value in data.items()}
        origins = {key: value.base for key, value in list_items.items()
                   if isinstance(value, store_lists.Extension)}
        for key, origin in origins.items():
            if not isinstance(origin.content.get(key), list):
                raise UsageError(f"step {origin.short_id} has no list {key!r} to extend")
        # Only the items given are encoded: an extension's earlier items are stored already.
        item_data = {
            key: [encoding.canonical_json(item) for item in (
                items.items if isinstance(items, store_lists.Extension) else items)]
            for key, items in list_items.items()
        }
        parent_id = parent.id if parent else None
        depth = parent.depth + 1 if parent else 1
        now = time.time()
        deferred = self._batch_moves() if new_run is None else None
        with self._write(flush=deferred is None) as conn:
            entries: dict[str, dict[str, Any]] = {}
            resolutions: dict[str, store_lists.Resolved] = {}
            blob_rows = {addresses[key]: value for key, value in data.items()}
            new_item_addresses: list[str] = []
            for key, encoded in item_data.items():
                item_addresses = [encoding.sha256_hex(item) for item in encoded]
                entries[key], resolutions[key] = self._list_entry(
                    conn, parent_id, key, item_addresses, origins.get(key))
                # The base's items are stored already: only the new ones are written
                # (and compressed), so a call costs what it adds, not its whole history.
                new_items = min(len(entries[key]["items"]), len(encoded))
                new_item_addresses += item_addresses[len(encoded) - new_items:]
                blob_rows.update(zip(item_addresses[len(encoded) - new_items:],
                                     encoded[len(encoded) - new_items:], strict=True))
            clean_meta = {key: value for key, value in meta.items() if value is not None}
            body = encoding.step_body(
                kind=kind, parent=parent_id, payload=addresses, raw=list(raw),
                meta=clean_meta, lists=entries,
            )
            step_id = encoding.sha256_hex(body)
            kept, body_codec = bodies.encode(body)
            skip_id, skip_depth = history.skip_for(conn, parent_id, depth, self._known)
            blob_list = self._payloads.rows(blob_rows, new_item_addresses)
            insert_ignore(conn, blobs, blob_list, "hash")
            insert_ignore(
                conn,
                steps,
                [
                    {
                        "id": step_id,
                        "parent_id": parent_id,
                        "kind": kind,
                        "depth": depth,
                        "body": kept,
                        "body_codec": body_codec,
                        "recorded_at": now,
                        "skip_id": skip_id,
                        "skip_depth": skip_depth,
                    }
                ],
                "id",
            )
            if new_run is not None:
                create_ref(conn, name, step_id, reason="fork", message=new_run)
            elif deferred is not None:  # moved when the batch is done (batched.py)
                deferred.append(name, parent_id, step_id, kind)
            else:
                move_ref(conn, name, parent_id, step_id, reason="append", message=kind)
        if len(self._known) >= _MAX_KNOWN or self._lists.is_full:
            self._known.clear()
            self._lists.clear()
        self._known[step_id] = (parent_id, depth, skip_id)
        self._payloads.note(blob_list, {addresses[key]: data[key] for key in data})
        for key, resolved in resolutions.items():
            self._lists[(step_id, key)] = resolved
        # Decoded from the canonical bytes: the Step never shares the caller's objects.
        content = {key: json.loads(data[key]) for key in payload}
        content.update(raw)
        for key, encoded in item_data.items():
            before = origins[key].content[key] if key in origins else []
            content[key] = [*before, *(json.loads(item) for item in encoded)]
        return Step(step_id, parent_id, kind, depth, addresses, clean_meta, content, now)

    def _list_entry(
        self, conn: Connection, parent_id: str | None, field: str, items: list[str],
        origin: Step | None,
    ) -> tuple[dict[str, Any], store_lists.Resolved]:
        """The body entry of list `field` of a new step after `parent_id`, and its resolution.

        `items` are the list's addresses, or with `origin` those after the
        list of step `origin` (an `Extension`). Either way the entry is the
        one the whole list gives (`entry_for`): ids never depend on how a
        list was passed. When `origin` is the base the store finds, as for a
        run's previous model call, nothing before `items` is touched.
        """
        base = self._list_base(conn, parent_id, field)
        if origin is None:
            return store_lists.entry_for(items, base)
        if base is not None and base[0] == origin.id:
            return store_lists.extend(origin.id, base[1], items)
        key = (origin.id, field)
        known = self._lists.get(key) or store_lists.resolve(
            store_lists.fetch_lists(conn), [key], self._lists)[key]
        return store_lists.entry_for([*known.addresses(), *items], base)

    def _list_base(
        self, conn: Any, parent_id: str | None, field: str
    ) -> tuple[str, store_lists.Resolved] | None:
        """(step id, resolved list) of `field` in the nearest ancestor that has it, or None.

        Looked up in memory first (a writer appending to its run finds it
        there), else in the last few steps of the history.
        """
        current, hops = parent_id, 0
        while current is not None and hops < _LIST_BASE_SEARCH and current in self._known:
            if (current, field) in self._lists:
                return current, self._lists[(current, field)]
            current, hops = self._known[current][0], hops + 1
        if current is None or hops >= _LIST_BASE_SEARCH:
            return None
        fetch = store_lists.fetch_lists(conn)
        chain = history.chain(conn, current, _LIST_BASE_SEARCH - hops)
        found = fetch(chain)
        for step_id in chain:
            if field in found.get(step_id, {}):
                key = (step_id, field)
                return step_id, store_lists.resolve(fetch, [key], self._lists)[key]
        return None
