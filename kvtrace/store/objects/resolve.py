"""Step addresses against the database: RUN, RUN@N, RUN~K or an id prefix to a step id.

names.py parses an address; this module looks it up, in the caller's
transaction. RUN@N and RUN~K use the skip pointers (`history.ancestor_at`),
so resolving is O(log n) whatever the run's length; an id prefix is a range
scan of the primary key (of raw bytes: schema.Address). A run name wins over
an id prefix that spells the same characters.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.errors import IntegrityError, RunNotFoundError, StepNotFoundError
from kvtrace.store.db.schema import refs, steps
from kvtrace.store.names import Spec, normalize_run_name, parse_spec
from kvtrace.store.objects import history

ID_LENGTH = 64  # hex characters of a step id


def ref_row(conn: Connection, name: str) -> Any:
    """The ref row of run `name` (its `head` may be None), or None when there is no such run."""
    name = normalize_run_name(name)
    return conn.execute(sa.select(refs.c.head).where(refs.c.name == name)).first()


def head_id(conn: Connection, name: str) -> str | None:
    """The head step id of run `name` (None for an empty run)."""
    row = ref_row(conn, name)
    if row is None:
        raise RunNotFoundError(f"no run named {name!r} (see `kvtrace runs`)")
    return row.head


def step_id(conn: Connection, text: str) -> str:
    """The full id of the step that address `text` names."""
    spec = parse_spec(text)
    if spec.run is not None:
        row = ref_row(conn, spec.run)
        if row is not None:
            return _position(conn, text, spec, row.head)
        if spec.prefix is None:
            raise RunNotFoundError(f"no run named {spec.run!r} (see `kvtrace runs`)")
    return _by_prefix(conn, spec.prefix or "")


def step_id_or_empty(conn: Connection, text: str) -> str | None:
    """Like `step_id`, but the bare name of an empty run gives None instead of an error."""
    parsed = parse_spec(text)
    if parsed.run is not None and parsed.number is None and parsed.back == 0:
        row = ref_row(conn, parsed.run)
        if row is not None:
            return row.head
    return step_id(conn, text)


def _position(conn: Connection, text: str, spec: Spec, head: str | None) -> str:
    if head is None:
        raise StepNotFoundError(f"run {spec.run!r} has no steps yet")
    depth = conn.execute(sa.select(steps.c.depth).where(steps.c.id == head)).scalar_one()
    target = spec.number if spec.number is not None else depth - spec.back
    if not 1 <= target <= depth:
        raise StepNotFoundError(f"{text!r} is outside run {spec.run!r}, which has {depth} steps")
    found = head if target == depth else history.ancestor_at(conn, head, target)
    if found is None:
        raise IntegrityError(f"the history of run {spec.run!r} is broken: run `kvtrace fsck`")
    return found


def _by_prefix(conn: Connection, prefix: str) -> str:
    # A range, not LIKE: both backends answer it from the primary-key index. Ids are
    # kept as raw bytes, so the range runs from the prefix padded with 0s to it padded
    # with fs (an odd number of hex digits is half a byte: padding completes it).
    ids = (
        conn.execute(
            sa.select(steps.c.id).where(
                steps.c.id.between(prefix.ljust(ID_LENGTH, "0"), prefix.ljust(ID_LENGTH, "f"))
            ).limit(2)
        )
        .scalars()
        .all()
    ) if len(prefix) <= ID_LENGTH else []
    if not ids:
        raise StepNotFoundError(f"no step or run matches {prefix!r}")
    if len(ids) > 1:
        raise StepNotFoundError(f"step-id prefix {prefix!r} is ambiguous: give more characters")
    return str(ids[0])
