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

In memory a resolved list is the same chain (`Resolved`: its base's
resolution, then its own items), never a flat copy: a conversation of n calls
then costs memory for its n calls' new items, not for n histories, and a
writer that extends its last call (`Extension`) does work for the new items
only. `addresses()` spells the whole list out when a reader needs it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.errors import IntegrityError
from kvtrace.store.db.schema import steps
from kvtrace.store.objects import bodies
from kvtrace.store.objects.encoding import list_entry_problem

if TYPE_CHECKING:
    from kvtrace.store.records import Step

MAX_DEPTH = 64
_IN_CHUNK = 500


@dataclass(frozen=True, slots=True, eq=False)
class Resolved:
    """A resolved list: its base's resolution (None for a list that names every item), then
    `items`, the addresses this step adds. `depth` counts the chain's links (1: no base)."""

    base: Resolved | None
    items: tuple[str, ...]
    depth: int
    length: int

    @staticmethod
    def of(base: Resolved | None, items: tuple[str, ...]) -> Resolved:
        """The resolution of a list that extends `base` (None: a list of `items` alone)."""
        if base is None:
            return Resolved(None, items, 1, len(items))
        return Resolved(base, items, base.depth + 1, base.length + len(items))

    def links(self) -> list[Resolved]:
        """The chain, root first: at most MAX_DEPTH links."""
        found: list[Resolved] = []
        node: Resolved | None = self
        while node is not None:
            found.append(node)
            node = node.base
        found.reverse()
        return found

    def addresses(self) -> tuple[str, ...]:
        """Every item address of the list, in order."""
        if self.base is None:
            return self.items
        return tuple(chain.from_iterable(link.items for link in self.links()))


@dataclass(frozen=True, slots=True)
class Extension:
    """A list field given as the list of an earlier step, then `items` (new values).

    What a writer that extends its own previous model call passes to
    `Store.append` (`Run.record_model_call(..., continues=True)`): the list
    means `base.content[field] + items`, and is stored exactly as that full
    list would be (same body, same id); when `base` is the list's base in the
    store, as it is for a run's previous call, only the new items are
    encoded and hashed.
    """

    base: Step
    items: list[Any]


# Where a list lives: (step id, field name).
ListKey = tuple[str, str]
# Reads step bodies: ids -> {id: the body's "lists" object}.
FetchLists = Callable[[list[str]], dict[str, dict[str, Any]]]


class ListCache(dict[ListKey, Resolved]):
    """Resolved lists by (step id, field), bounded by the item addresses they hold.

    An entry holds the addresses its step adds (`Resolved.items`; its base's
    are the base's entry), and a list that names every item (one call in
    `MAX_DEPTH`, or any list without a base) holds all of them, so a bound
    on entries alone does not bound memory. `num_items` counts the addresses
    the entries hold; `make_room` empties the cache once it holds more than
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
            self.num_items -= len(previous.items)
        super().__setitem__(key, value)
        self.num_items += len(value.items)

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
        step_id, resolved = base
        count = resolved.length
        if count and resolved.depth < MAX_DEPTH and (
            tuple(items[:count]) == resolved.addresses()
        ):
            return extend(step_id, resolved, items[count:])
    return {"base": None, "items": list(items)}, Resolved.of(None, tuple(items))


def extend(
    step_id: str, base: Resolved, items: list[str]
) -> tuple[dict[str, Any], Resolved]:
    """The body entry of a list that is `base` (the list of step `step_id`), then `items`.

    The caller knows the list extends its base, so nothing before `items` is
    compared or copied; a chain at MAX_DEPTH names every item, as `entry_for`
    would.
    """
    if base.depth >= MAX_DEPTH or not base.length:
        return entry_for([*base.addresses(), *items], None)
    return {"base": step_id, "items": list(items)}, Resolved.of(base, tuple(items))


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
        base = None
        if entry["base"] is not None:
            base = full((entry["base"], key[1]), trail + 1)
            if base.depth + 1 > MAX_DEPTH:
                raise IntegrityError(f"step {key[0][:12]} ends a list chain that is too long")
        # Interned: every 64th step names every address again, and a cache of resolved
        # lists would otherwise hold a copy of each address per such step (n^2/64 of them).
        known[key] = Resolved.of(base, tuple(map(sys.intern, entry["items"])))
        return known[key]

    return {key: full(key) for key in wanted}


def fetch_lists(conn: Connection) -> FetchLists:
    """A `fetch` for `resolve` that reads step bodies from the store's database."""

    def fetch(ids: list[str]) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for start in range(0, len(ids), _IN_CHUNK):
            query = sa.select(steps.c.id, steps.c.body, steps.c.body_codec).where(
                steps.c.id.in_(ids[start : start + _IN_CHUNK]))
            for step_id, body, body_codec in conn.execute(query):
                found[step_id] = lists_of(json.loads(bodies.decode(body, body_codec)))
        return found

    return fetch


def lists_of(body: Mapping[str, Any]) -> dict[str, Any]:
    """The "lists" object of a decoded body ({} for version 1)."""
    value = body.get("lists")
    return value if isinstance(value, dict) else {}


def growth(
    resolved: Resolved, base: str | None, previous: tuple[str, Resolved] | None
) -> tuple[int, tuple[str, ...]]:
    """(kept, added): how a list (`resolved`, whose body names `base`) grows the previous list
    of its field in a walk ((step id, resolution), None for the first): how many leading
    items it keeps, and the addresses after them.

    A list built on the previous one keeps it whole and adds its own items:
    nothing else is looked at. Otherwise (each MAX_DEPTH-th step, or a
    history that was edited) the two lists are compared address by address.
    """
    if previous is None:
        return 0, resolved.addresses()
    previous_id, before = previous
    if base == previous_id:
        return before.length, resolved.items
    whole = resolved.addresses()
    kept = shared_prefix(before.addresses(), whole)
    return kept, whole[kept:]


def shared_prefix(before: Sequence[Any], after: Sequence[Any]) -> int:
    """How many leading items of `after` are equal to `before`'s (compared in C when all are)."""
    if list(after[: len(before)]) == list(before):
        return len(before)
    kept = 0
    for old, new in zip(before, after, strict=False):
        if old != new:
            break
        kept += 1
    return kept


class Decoded:
    """The decoded list items of one read, shared by every step it loads.

    The steps of a conversation share their chain links, so each item is
    decoded once however many steps list it (by address: a link that names
    every item again, as each MAX_DEPTH-th step does, decodes nothing new),
    and a step's list is a copy of at most MAX_DEPTH tuples. The values are
    shared between the steps of the read: a Step is a record, not to be
    changed.
    """

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self._links: dict[Resolved, tuple[Any, ...]] = {}  # by identity: links are unique

    def wanted(self, resolutions: Iterable[Resolved]) -> set[str]:
        """The item addresses `values` needs read first for these lists (not decoded yet).

        Each link is looked at once, however many of the lists share it.
        """
        links = {link for resolved in resolutions for link in resolved.links()
                 if link not in self._links}
        return {item for link in links for item in link.items if item not in self._values}

    def values(self, resolved: Resolved, data: Mapping[str, bytes]) -> list[Any]:
        """The decoded items of a resolved list, given the blobs `wanted` named in `data`."""
        parts = []
        for link in resolved.links():
            found = self._links.get(link)
            if found is None:
                missing = [item for item in link.items if item not in self._values]
                self._values.update(zip(missing, decode_items(missing, data), strict=True))
                found = self._links[link] = tuple(map(self._values.__getitem__, link.items))
            parts.append(found)
        return list(chain.from_iterable(parts))


def decode_items(addresses: Iterable[str], data: Mapping[str, bytes]) -> list[Any]:
    """The decoded list items at `addresses`, whose blobs are in `data`."""
    values = []
    for item in addresses:
        if item not in data:
            raise IntegrityError(f"list item {item[:12]} is missing")
        values.append(json.loads(data[item]))
    return values
