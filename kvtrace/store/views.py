"""Views over history that compare runs: where they part, where they branch.

Both take chains of step ids already walked by `history.chain` and read only
what they show, in the caller's read transaction.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.store import history
from kvtrace.store.records import Divergence, Step
from kvtrace.store.schema import refs, steps


def graph_rows(conn: Connection, chain: list[str]) -> list[tuple[Step, list[str], int]]:
    """Each step of `chain` with the runs whose head it is and how many other branches leave it."""
    heads: dict[str, list[str]] = {}
    for name, head in conn.execute(
        sa.select(refs.c.name, refs.c.head).where(refs.c.head.is_not(None))
    ):
        heads.setdefault(head, []).append(name)
    on_chain = set(chain)
    branches: dict[str, int] = {}
    for part in history.chunks(chain):
        for parent, child in conn.execute(
            sa.select(steps.c.parent_id, steps.c.id).where(steps.c.parent_id.in_(part))
        ):
            if child not in on_chain:
                branches[parent] = branches.get(parent, 0) + 1
    return [
        (step, sorted(heads.get(step.id, [])), branches.get(step.id, 0))
        for step in history.load_steps(conn, chain)
    ]


def divergence(conn: Connection, chain_a: list[str], chain_b: list[str]) -> Divergence:
    """Where two root-first chains part: last common step and the first of each after it."""
    shared = 0
    while shared < min(len(chain_a), len(chain_b)) and chain_a[shared] == chain_b[shared]:
        shared += 1
    wanted = [chain_a[shared - 1]] if shared else []
    wanted += chain_a[shared : shared + 1] + chain_b[shared : shared + 1]
    loaded = {step.id: step for step in history.load_steps(conn, wanted)}
    return Divergence(
        common=loaded[chain_a[shared - 1]] if shared else None,
        first_a=loaded.get(chain_a[shared]) if shared < len(chain_a) else None,
        first_b=loaded.get(chain_b[shared]) if shared < len(chain_b) else None,
        num_only_a=len(chain_a) - shared,
        num_only_b=len(chain_b) - shared,
    )
