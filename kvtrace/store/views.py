"""Views over history that compare runs: where they part, where they branch.

Both take chains of step ids already walked by `history.chain` and read only
what they show, in the caller's read transaction.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.store import history
from kvtrace.store.records import Divergence, GraphRow
from kvtrace.store.schema import refs, steps

# Naming the runs that leave a chain costs one ancestor query per run and
# branch depth; past this many runs only the branches are counted.
MAX_RUNS_TO_NAME = 200


def graph_rows(conn: Connection, chain: list[str]) -> list[GraphRow]:
    """Each step of `chain`, the runs whose head it is, and the branches (and runs) leaving it."""
    heads: dict[str, list[str]] = {}
    for name, head in conn.execute(
        sa.select(refs.c.name, refs.c.head).where(refs.c.head.is_not(None))
    ):
        heads.setdefault(head, []).append(name)
    on_chain = set(chain)
    leaving: dict[str, str] = {}  # child off the chain -> the chain step it leaves
    num_branches: dict[str, int] = {}
    for part in history.chunks(chain):
        for parent, child in conn.execute(
            sa.select(steps.c.parent_id, steps.c.id).where(steps.c.parent_id.in_(part))
        ):
            if child not in on_chain:
                leaving[child] = parent
                num_branches[parent] = num_branches.get(parent, 0) + 1
    runs = _runs_taking(conn, leaving, heads)
    return [
        GraphRow(
            step,
            sorted(heads.get(step.id, [])),
            num_branches.get(step.id, 0),
            sorted(runs.get(step.id, [])),
        )
        for step in history.load_steps(conn, chain)
    ]


def _runs_taking(
    conn: Connection, leaving: dict[str, str], heads: dict[str, list[str]]
) -> dict[str, list[str]]:
    """For each chain step with branches, the runs whose history takes one of them."""
    num_runs = sum(len(names) for names in heads.values())
    if not leaving or num_runs > MAX_RUNS_TO_NAME:
        return {}
    depth = {s.id: s.depth for s in history.load_steps(conn, list(leaving))}
    found: dict[str, list[str]] = {}
    for head, names in heads.items():
        for target in sorted(set(depth.values())):
            ancestor = history.ancestor_at(conn, head, target)
            if ancestor in leaving:
                found.setdefault(leaving[ancestor], []).extend(names)
    return found


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
