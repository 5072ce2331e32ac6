"""List fields: how a model call's messages are stored, item by item, once.

A chat conversation grows by a few messages per model call, and every call
sends all of it. Stored as one blob per call, a run of n calls would hold its
history n times over. Instead each item (message) is its own canonical-JSON
blob, and a step's body names the list as

    "lists": {"messages": {"base": STEP_ID | null, "items": [ADDRESS, ...]}}

meaning "the items of that field in step `base`, then these". A model call
whose messages extend an earlier call's (the usual case) names that call as
its base and lists only the new messages, so a run's bytes grow with its
distinct messages, not with their square. The base is always an ancestor of
the step (the nearest one with the field), so it travels with the step in
every bundle, and the step id, which hashes the body, pins the whole list.

A chain of bases never grows past `MAX_DEPTH` steps: the step that would
exceed it lists every item itself, so reading any list takes at most
`MAX_DEPTH` rounds of queries, and a longer chain is refused as corrupt.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.errors import IntegrityError
from kvtrace.store.encoding import list_entry_problem
from kvtrace.store.schema import steps

MAX_DEPTH = 64
_IN_CHUNK = 500

# A resolved list: (the length of its chain of bases, every item address in order).
Resolved = tuple[int, tuple[str, ...]]
# Where a list lives: (step id, field name).
ListKey = tuple[str, str]
# Reads step bodies: ids -> {id: the body's "lists" object}.
FetchLists = Callable[[list[str]], dict[str, dict[str, Any]]]


class ListCache(dict[ListKey, Resolved]):
    """Resolved lists by (step id, field), bounded by the item addresses they hold.

    An entry holds a tuple of every address of its list, so a bound on
    entries alone does not bound memory: 20,000 lists of a 2,000-message
    conversation are 40 M tuple slots (320 MB). `num_items` counts the slots
    of every entry; `make_room` empties the cache once it holds more than
    `max_items` slots or `max_entries` entries. It is called between
    operations, never inside `resolve`, which reads back the entries it has
    just put in; so the cache can pass its bounds by one operation's lists.
    Entries are only ever set (`cache[key] = resolved`) or all cleared.
    """

    def __init__(self, *, max_entries: int, max_items: int) -> None:
        super().__init__()
        self.max_entries = max_entries
        self.max_items = max_items
        self.num_items = 0

    def __setitem__(self, key: ListKey, value: Resolved) -> None:
        previous = self.get(key)
        if previous is not None:
            self.num_items -= len(previous[1])
        super().__setitem__(key, value)
        self.num_items += len(value[1])

    def clear(self) -> None:
        super().clear()
        self.num_items = 0

    @property
    def is_full(self) -> bool:
        return len(self) >= self.max_entries or self.num_items >= self.max_items

    def make_room(self) -> ListCache:
        """Itself, emptied first when it is full."""
        if self.is_full:
            self.clear()
        return self


def entry_for(
    items: list[str], base: tuple[str, Resolved] | None
) -> tuple[dict[str, Any], Resolved]:
    """The body entry of a list of item addresses, extending `base` when it can.

    `base` is (step id, resolved list) of the nearest ancestor with the field;
    it is used only when its items are a prefix of `items` and the chain stays
    short enough. Returns (the entry, its resolution).
    """
    if base is not None:
        step_id, (depth, base_items) = base
        count = len(base_items)
        if count and depth < MAX_DEPTH and tuple(items[:count]) == base_items:
            # The base's own address strings, not the equal ones just computed: a
            # store's cache of resolved lists then holds each address once per
            # conversation, not once per call (113 bytes a call for every item).
            return ({"base": step_id, "items": items[count:]},
                    (depth + 1, base_items + tuple(items[count:])))
    return {"base": None, "items": list(items)}, (1, tuple(items))


def resolve(
    fetch: FetchLists, keys: Iterable[ListKey], known: MutableMapping[ListKey, Resolved]
) -> dict[ListKey, Resolved]:
    """Resolve lists to their full item lists, reading base steps in rounds.

    `fetch` reads the "lists" objects of step bodies; `known` caches
    resolutions (steps never change, so a cached one is always right) and is
    filled with every list met on the way.
    """
    wanted = set(keys)
    entries: dict[ListKey, dict[str, Any]] = {}
    frontier = {key for key in wanted if key not in known}
    for _ in range(MAX_DEPTH + 1):
        if not frontier:
            break
        found = fetch(sorted({step_id for step_id, _ in frontier}))
        for step_id, field in frontier:
            entry = found.get(step_id, {}).get(field)
            if entry is None:
                raise IntegrityError(f"step {step_id[:12]} has no list {field!r} to build on")
            problem = list_entry_problem(entry)
            if problem:
                raise IntegrityError(f"step {step_id[:12]}: {problem}")
            entries[(step_id, field)] = entry
        frontier = {
            (entry["base"], field) for (_, field), entry in entries.items()
            if entry["base"] is not None and (entry["base"], field) not in known
            and (entry["base"], field) not in entries
        }
    else:
        raise IntegrityError("a list's chain of base steps is deeper than allowed")

    def full(key: ListKey, trail: int = 0) -> Resolved:
        if key in known:
            return known[key]
        if trail > MAX_DEPTH:
            raise IntegrityError("a list's chain of base steps loops or is too deep")
        entry = entries[key]
        depth, prefix = 1, tuple[str, ...]()
        if entry["base"] is not None:
            base_depth, prefix = full((entry["base"], key[1]), trail + 1)
            depth = base_depth + 1
            if depth > MAX_DEPTH:
                raise IntegrityError(f"step {key[0][:12]} ends a list chain that is too long")
        known[key] = (depth, prefix + tuple(entry["items"]))
        return known[key]

    return {key: full(key) for key in wanted}


def fetch_lists(conn: Connection) -> FetchLists:
    """A `fetch` for `resolve` that reads step bodies from the store's database."""

    def fetch(ids: list[str]) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for start in range(0, len(ids), _IN_CHUNK):
            query = sa.select(steps.c.id, steps.c.body).where(
                steps.c.id.in_(ids[start : start + _IN_CHUNK]))
            for step_id, body in conn.execute(query):
                found[step_id] = lists_of(json.loads(bytes(body)))
        return found

    return fetch


def lists_of(body: Mapping[str, Any]) -> dict[str, Any]:
    """The "lists" object of a decoded body ({} for version 1)."""
    value = body.get("lists")
    return value if isinstance(value, dict) else {}


def item_values(resolved: Resolved, data: Mapping[str, bytes]) -> list[Any]:
    """The decoded items of a resolved list, given every item blob in `data`."""
    values = []
    for item in resolved[1]:
        if item not in data:
            raise IntegrityError(f"list item {item[:12]} is missing")
        values.append(json.loads(data[item]))
    return values
