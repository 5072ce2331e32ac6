"""List segments: how a list payload (a model call's messages) is stored item by item.

A chat conversation grows by a few messages per model call, and every call
sends all of it. Stored as one blob per call, a run of n calls would hold its
history n times over. Instead each item (message) is its own canonical-JSON
blob, and the list is a chain of *segments*, each a canonical-JSON blob

    {"base": ADDRESS | null, "items": [ADDRESS, ...]}

meaning "the items of segment `base`, then these". A model call whose messages
extend the previous call's (the usual case) stores one small segment naming
the previous call's segment as its base, plus the new messages' blobs, so a
run's bytes grow with its distinct messages, not with their square.

A chain never grows past `MAX_DEPTH` segments: the segment that would exceed
it lists every item itself, so reading any list takes at most `MAX_DEPTH`
rounds of queries, and a longer chain is refused as corrupt. Segments are
content-addressed like every blob: identical histories (a fork, a re-recorded
prefix) share them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.errors import IntegrityError
from kvtrace.store.encoding import canonical_json, decode_json_blob, is_address, sha256_hex
from kvtrace.store.schema import blobs

MAX_DEPTH = 64
_IN_CHUNK = 500

# A resolved segment: (its chain's length, every item address in order).
Resolved = tuple[int, tuple[str, ...]]


def segment_for(
    items: list[str], base: tuple[str, Resolved] | None
) -> tuple[bytes, str, Resolved]:
    """The segment blob for the item addresses `items`, extending `base` when it can.

    `base` is (address, resolved) of a segment whose items may be a prefix of
    `items`; it is used only when it is one and the chain stays short enough.
    Returns (segment bytes, its address, its resolution).
    """
    base_address: str | None = None
    depth, own = 1, items
    if base is not None:
        address, (base_depth, base_items) = base
        count = len(base_items)
        if base_depth < MAX_DEPTH and tuple(items[:count]) == base_items and count:
            base_address, depth, own = address, base_depth + 1, items[count:]
    data = canonical_json({"base": base_address, "items": own})
    return data, sha256_hex(data), (depth, tuple(items))


def parse_segment(data: bytes, address: str = "") -> tuple[str | None, list[str]]:
    """(base, items) of a segment blob; IntegrityError when malformed."""
    value = decode_json_blob(data)
    label = f"list segment {address[:12]}" if address else "list segment"
    if not isinstance(value, dict) or set(value) != {"base", "items"}:
        raise IntegrityError(f"{label} is malformed: needs base and items")
    base, items = value["base"], value["items"]
    if base is not None and not is_address(base):
        raise IntegrityError(f"{label} has a base that is not a blob address")
    if not isinstance(items, list) or not all(is_address(a) for a in items):
        raise IntegrityError(f"{label} has items that are not blob addresses")
    return base, items


def resolve(
    fetch: Any, addresses: Iterable[str], known: MutableMapping[str, Resolved]
) -> dict[str, Resolved]:
    """Resolve segments to their full item lists, fetching missing ones in rounds.

    `fetch(addresses) -> {address: bytes}` reads blobs (from the database or a
    bundle); `known` caches resolutions (segments never change, so a cached
    one is always right) and is filled with every segment met on the way.
    """
    wanted = set(addresses)
    parsed: dict[str, tuple[str | None, list[str]]] = {}
    frontier = {a for a in wanted if a not in known}
    for _ in range(MAX_DEPTH + 1):
        if not frontier:
            break
        found = fetch(sorted(frontier))
        missing = frontier - set(found)
        if missing:
            raise IntegrityError(f"list segment {sorted(missing)[0][:12]} is missing")
        for address, data in found.items():
            parsed[address] = parse_segment(bytes(data), address)
        frontier = {
            base for base, _ in parsed.values()
            if base is not None and base not in known and base not in parsed
        }
    else:
        raise IntegrityError("a list segment chain is deeper than allowed")

    def full(address: str, trail: int = 0) -> Resolved:
        if address in known:
            return known[address]
        if trail > MAX_DEPTH:
            raise IntegrityError("a list segment chain loops or is too deep")
        base, items = parsed[address]
        depth, prefix = 1, tuple[str, ...]()
        if base is not None:
            base_depth, prefix = full(base, trail + 1)
            depth = base_depth + 1
            if depth > MAX_DEPTH:
                raise IntegrityError(f"list segment {address[:12]} ends a chain that is too long")
        known[address] = (depth, prefix + tuple(items))
        return known[address]

    return {address: full(address) for address in wanted}


def fetch_blobs(conn: Connection) -> Any:
    """A `fetch` for `resolve` that reads blobs from the store's database."""

    def fetch(addresses: list[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for start in range(0, len(addresses), _IN_CHUNK):
            part = addresses[start : start + _IN_CHUNK]
            query = sa.select(blobs.c.hash, blobs.c.data).where(blobs.c.hash.in_(part))
            found.update((h, bytes(d)) for h, d in conn.execute(query))
        return found

    return fetch


def item_values(
    resolved: Mapping[str, Resolved], data: Mapping[str, bytes], address: str
) -> list[Any]:
    """The decoded items of segment `address`, given every item blob in `data`."""
    values = []
    for item in resolved[address][1]:
        if item not in data:
            raise IntegrityError(f"list item {item[:12]} is missing")
        values.append(json.loads(data[item]))
    return values


def closure(fetch: Any, addresses: Iterable[str]) -> set[str]:
    """Every blob the segments `addresses` need: the segments of their chains and the items."""
    needed: set[str] = set()
    frontier = set(addresses)
    while frontier:
        found = fetch(sorted(frontier))
        missing = frontier - set(found)
        if missing:
            raise IntegrityError(f"list segment {sorted(missing)[0][:12]} is missing")
        needed |= frontier
        frontier = set()
        for address, data in found.items():
            base, items = parse_segment(bytes(data), address)
            needed.update(items)
            if base is not None and base not in needed:
                frontier.add(base)
    return needed
