"""Walking history: ancestors, chains, and loading steps with their content.

Every step row carries a *skip pointer* (`skip_id`, `skip_depth`): a link to
one ancestor far back, chosen by depth alone as in Bitcoin's block index
(``skip_height``). Following it whenever it does not overshoot reaches the
ancestor at any depth in O(log n) hops, and those hops run inside one
recursive SQL query. So `RUN@N`, `RUN~K` and revert's ancestry check cost the
same at 10 steps and at 10,000. Skip pointers are derived data, like `depth`:
set once when a step is inserted, never hashed, and checked by fsck.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.errors import IntegrityError, StepNotFoundError
from kvtrace.store.db.schema import steps
from kvtrace.store.objects import bodies, codec, lists
from kvtrace.store.records import Growth, Step

_IN_CHUNK = 500


def _invert_lowest_one(n: int) -> int:
    return n & (n - 1)


def skip_depth(depth: int) -> int | None:
    """The depth a step's skip pointer points to (None for the first two steps)."""
    height = depth - 1  # Bitcoin's formula counts from 0
    if height < 2:
        return None
    if height & 1:
        skip = _invert_lowest_one(_invert_lowest_one(height - 1)) + 1
    else:
        skip = _invert_lowest_one(height)
    return skip + 1


def ancestor_at(conn: Connection, start: str, target_depth: int) -> str | None:
    """The ancestor of `start` (or `start` itself) at `target_depth`, in one query."""
    target = sa.bindparam("target", target_depth, type_=sa.Integer)
    walk = (
        sa.select(steps.c.id, steps.c.depth, steps.c.parent_id, steps.c.skip_id, steps.c.skip_depth)
        .where(steps.c.id == start)
        .cte("walk", recursive=True)
    )
    hop = sa.case(
        (sa.and_(walk.c.skip_id.is_not(None), walk.c.skip_depth >= target), walk.c.skip_id),
        else_=walk.c.parent_id,
    )
    walk = walk.union_all(
        sa.select(steps.c.id, steps.c.depth, steps.c.parent_id, steps.c.skip_id, steps.c.skip_depth)
        .join(walk, steps.c.id == hop)
        .where(walk.c.depth > target)
    )
    found = conn.execute(sa.select(walk.c.id).where(walk.c.depth == target)).scalar()
    return str(found) if found is not None else None


def skip_for(
    conn: Connection,
    parent_id: str | None,
    depth: int,
    known: Mapping[str, tuple[str | None, int, str | None]],
) -> tuple[str | None, int | None]:
    """The skip pointer of a new step at `depth` whose parent is `parent_id`.

    `known` caches (parent, depth, skip) of steps this process has seen; steps
    never change, so a hit is always right, and a writer appending to a run
    finds every hop there without a query.
    """
    target = skip_depth(depth)
    if target is None or parent_id is None:
        return None, None
    if target == depth - 1:
        return parent_id, target
    try:
        return skip_in_memory(parent_id, depth, known.__getitem__)
    except KeyError:
        pass
    found = ancestor_at(conn, parent_id, target)
    if found is None:
        raise IntegrityError(f"the history of {parent_id[:12]} is broken: run `kvtrace fsck`")
    return found, target


def skip_in_memory(
    parent_id: str | None, depth: int, lookup: Callable[[str], tuple[str | None, int, str | None]]
) -> tuple[str | None, int | None]:
    """Like `skip_for`, walking rows given by `lookup(id) -> (parent, depth, skip)`.

    Every hop must reach a shallower step, or the walk stops with an IntegrityError:
    rows changed behind kvtrace's back (fsck walks stored rows) cannot make it loop.
    """
    target = skip_depth(depth)
    if target is None or parent_id is None:
        return None, None
    current = parent_id
    below = depth
    while True:
        parent, current_depth, skip = lookup(current)
        if current_depth >= below:
            raise _loop(current, current_depth, below)
        below = current_depth
        if current_depth == target:
            return current, target
        current_skip = skip_depth(current_depth)
        if skip is not None and current_skip is not None and current_skip >= target:
            current = skip
        elif parent is not None:
            current = parent
        else:
            raise IntegrityError(f"step {current[:12]} has no ancestor at depth {target}")


def ancestor_in_memory(
    start: str, target_depth: int, lookup: Callable[[str], tuple[str | None, int, str | None]]
) -> str | None:
    """The ancestor of `start` (or itself) at `target_depth`, walking rows given by
    `lookup(id) -> (parent, depth, skip)` along skip pointers; None if there is none.
    Like `skip_in_memory`, a hop that does not reach a shallower step is an IntegrityError."""
    current: str | None = start
    below: int | None = None
    while current is not None:
        parent, depth, skip = lookup(current)
        if below is not None and depth >= below:
            raise _loop(current, depth, below)
        below = depth
        if depth <= target_depth:
            return current if depth == target_depth else None
        reach = skip_depth(depth)
        current = skip if skip is not None and reach is not None and reach >= target_depth else (
            parent)
    return None


def _loop(step_id: str, depth: int, below: int) -> IntegrityError:
    """The error of a walk that reached `step_id`, at `depth`, by a hop from depth `below`."""
    return IntegrityError(f"the history of {step_id[:12]} loops (depth {depth} reached from "
                          f"depth {below}): run `kvtrace fsck`")


def is_ancestor(conn: Connection, ancestor: str, descendant: str) -> bool:
    """Whether `ancestor` is a strict ancestor of `descendant`."""
    depths = dict(
        conn.execute(
            sa.select(steps.c.id, steps.c.depth).where(steps.c.id.in_([ancestor, descendant]))
        ).all()
    )
    if ancestor not in depths or descendant not in depths:
        return False
    if depths[ancestor] >= depths[descendant]:
        return False
    return ancestor_at(conn, descendant, depths[ancestor]) == ancestor


def chain(conn: Connection, start: str, limit: int | None) -> list[str]:
    """Ids from `start` back towards the root, at most `limit` of them (log needs them all)."""
    walk = (
        sa.select(steps.c.id, steps.c.parent_id, sa.literal(1).label("n"))
        .where(steps.c.id == start)
        .cte("chain", recursive=True)
    )
    step = sa.select(steps.c.id, steps.c.parent_id, (walk.c.n + 1).label("n")).join(
        walk, steps.c.id == walk.c.parent_id
    )
    if limit is not None:
        step = step.where(walk.c.n < limit)
    walk = walk.union_all(step)
    return [str(r) for r in conn.execute(sa.select(walk.c.id).order_by(walk.c.n)).scalars()]


def chunks(items: list[str]) -> Iterable[list[str]]:
    """Slices small enough for an IN (...) list on every backend."""
    for start in range(0, len(items), _IN_CHUNK):
        yield items[start : start + _IN_CHUNK]


def load_steps(
    conn: Connection,
    ids: list[str],
    known_lists: MutableMapping[lists.ListKey, lists.Resolved] | None = None,
    decoded: lists.Decoded | None = None,
    *,
    with_lists: bool = True,
) -> list[Step]:
    """Steps with their content, in the order of `ids`.

    List fields (a model call's messages) are resolved to their items through
    their base steps; `known_lists` caches resolutions across calls, and
    `decoded` the items already read and decoded (a walk over a long run
    passes one for all its pages, so each message is read and decoded once).
    Without `with_lists` they are left out of the content: a listing that
    shows each step in a line reads no conversation.
    """
    rows, bodies = _read(conn, ids)
    keys = [(i, field) for i, body in bodies.items() for field in lists.lists_of(body)
            if with_lists]
    resolved = lists.resolve(_fetch(conn, bodies), keys,
                             known_lists if known_lists is not None else {})
    decoded = decoded if decoded is not None else lists.Decoded()
    wanted = {address for body in bodies.values() for address in body["payload"].values()}
    wanted.update(decoded.wanted(resolved[key] for key in keys))
    data = codec.read(conn, wanted)
    return [_step(rows[i], bodies[i], data, resolved, decoded, with_lists) for i in ids]


def load_growth(
    conn: Connection,
    ids: list[str],
    known_lists: MutableMapping[lists.ListKey, lists.Resolved],
    last: dict[str, tuple[str, lists.Resolved]],
) -> list[tuple[Step, dict[str, Growth]]]:
    """Steps without their list fields, each with how its lists grow the walk's previous ones.

    `last` maps each field to the walk's previous (step id, resolution) that
    has it, and is moved on as the steps are read. Only the added items are
    read and decoded: each message of a conversation once.
    """
    rows, bodies = _read(conn, ids)
    keys = [(i, field) for i, body in bodies.items() for field in lists.lists_of(body)]
    resolved = lists.resolve(_fetch(conn, bodies), keys, known_lists)
    plans: list[dict[str, tuple[int, int, tuple[str, ...]]]] = []
    for step_id in ids:
        plan = {}
        for field, entry in lists.lists_of(bodies[step_id]).items():
            resolution = resolved[(step_id, field)]
            kept, added = lists.growth(resolution, entry["base"], last.get(field))
            plan[field] = (resolution.length, kept, added)
            last[field] = (step_id, resolution)
        plans.append(plan)
    wanted = {address for body in bodies.values() for address in body["payload"].values()}
    wanted.update(a for plan in plans for _, _, added in plan.values() for a in added)
    data = codec.read(conn, wanted)
    out = []
    for step_id, plan in zip(ids, plans, strict=True):
        step = _step(rows[step_id], bodies[step_id], data, resolved, lists.Decoded(), False)
        out.append((step, {field: Growth(length, kept, lists.decode_items(added, data))
                           for field, (length, kept, added) in plan.items()}))
    return out


def _read(conn: Connection, ids: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The rows of steps `ids` and their decoded bodies."""
    rows: dict[str, Any] = {}
    for part in chunks(ids):
        for row in conn.execute(sa.select(steps).where(steps.c.id.in_(part))):
            rows[row.id] = row
    missing = [i for i in ids if i not in rows]
    if missing:
        raise StepNotFoundError(f"step {missing[0][:12]} is missing from the store")
    return rows, {i: json.loads(bodies.decode(rows[i].body, rows[i].body_codec)) for i in ids}


def _fetch(conn: Connection, bodies: dict[str, dict[str, Any]]) -> lists.FetchLists:
    """A `fetch` for `lists.resolve` that finds the bodies already read before asking."""
    loaded = {i: lists.lists_of(body) for i, body in bodies.items()}
    fetch_db = lists.fetch_lists(conn)

    def fetch(step_ids: list[str]) -> dict[str, dict[str, Any]]:
        found = {i: loaded[i] for i in step_ids if i in loaded}
        rest = [i for i in step_ids if i not in loaded]
        return {**found, **fetch_db(rest)} if rest else found

    return fetch


def _step(
    row: Any,
    body: dict[str, Any],
    data: dict[str, bytes],
    resolved: Mapping[lists.ListKey, lists.Resolved],
    decoded: lists.Decoded,
    with_lists: bool,
) -> Step:
    content: dict[str, Any] = {}
    for key in lists.lists_of(body) if with_lists else ():
        content[key] = decoded.values(resolved[(row.id, key)], data)
    for key, address in body["payload"].items():
        if address not in data:
            raise IntegrityError(f"step {row.id[:12]} refers to missing blob {address[:12]}")
        blob = data[address]
        try:
            content[key] = blob if key in body["raw"] else json.loads(blob)
        except (ValueError, RecursionError) as exc:
            raise IntegrityError(
                f"blob {address[:12]} of step {row.id[:12]} is not JSON a reader can load: {exc}"
            ) from exc
    return Step(
        row.id,
        row.parent_id,
        row.kind,
        row.depth,
        body["payload"],
        body["meta"],
        content,
        row.recorded_at,
    )
