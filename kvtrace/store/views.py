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

# Naming the runs that leave a chain costs ~log2(chain length) ancestor
# queries per run off the chain; past this many such runs they go unnamed.
MAX_RUNS_TO_NAME = 200


def graph_rows(conn: Connection, chain: list[str]) -> list[GraphRow]:
    """Each step of `chain`, the runs whose head it is, and the branches (and runs) leaving it."""
    loaded = history.load_steps(conn, chain)
    heads, num_branches, runs = _branches(conn, {step.id: step.depth for step in loaded})
    return [
        GraphRow(
            step,
            sorted(heads.get(step.id, [])),
            num_branches.get(step.id, 0),
            None if runs is None else sorted(runs.get(step.id, [])),
        )
        for step in loaded
    ]


def forks(conn: Connection, chain: list[str]) -> list[tuple[str, int]]:
    """(run, depth of the step it leaves from) of each run that leaves `chain`, by depth.

    What `graph_rows` tells of branches, without reading any step's content:
    a long run's report needs the forks, not a second copy of every step.
    """
    depth: dict[str, int] = {}
    for part in history.chunks(chain):
        depth.update(conn.execute(
            sa.select(steps.c.id, steps.c.depth).where(steps.c.id.in_(part))).all())
    _, _, runs = _branches(conn, depth)
    return sorted(((run, depth[step_id]) for step_id, names in (runs or {}).items()
                   for run in names), key=lambda fork: (fork[1], fork[0]))


def _branches(
    conn: Connection, depth: dict[str, int]
) -> tuple[dict[str, list[str]], dict[str, int], dict[str, list[str]] | None]:
    """For a chain (its steps' depths): the runs headed at each step, the number of
    branches leaving each, and the runs taking them (None: too many to name)."""
    heads: dict[str, list[str]] = {}
    head_depth: dict[str, int] = {}
    for name, head, head_at in conn.execute(
        sa.select(refs.c.name, refs.c.head, steps.c.depth).join(steps, steps.c.id == refs.c.head)
    ):
        heads.setdefault(head, []).append(name)
        head_depth[head] = head_at
    leaving: dict[str, str] = {}  # child off the chain -> the chain step it leaves
    num_branches: dict[str, int] = {}
    for part in history.chunks(list(depth)):
        for parent, child in conn.execute(
            sa.select(steps.c.parent_id, steps.c.id).where(steps.c.parent_id.in_(part))
        ):
            if child not in depth:
                leaving[child] = parent
                num_branches[parent] = num_branches.get(parent, 0) + 1
    off_chain = {head: d for head, d in head_depth.items() if head not in depth}
    return heads, num_branches, _runs_taking(conn, depth, leaving, off_chain, heads)


def _runs_taking(
    conn: Connection, chain_depth: dict[str, int], leaving: dict[str, str],
    off_chain: dict[str, int], heads: dict[str, list[str]],
) -> dict[str, list[str]] | None:
    """For each chain step with branches, the runs (headed off the chain) that take one.

    `off_chain` maps each head off the chain to its depth. A head's ancestors
    lie on the chain up to the depth where it leaves, and off it after, so
    that depth is found by bisection. None when there are too many runs to
    name.
    """
    if not leaving:
        return {}
    if sum(len(heads[head]) for head in off_chain) > MAX_RUNS_TO_NAME:
        return None
    lowest, highest = min(chain_depth.values()), max(chain_depth.values())
    found: dict[str, list[str]] = {}
    for head, depth in off_chain.items():
        if depth <= lowest or history.ancestor_at(conn, head, lowest) not in chain_depth:
            continue  # shallower than the chain shown, or leaves it before its first step
        on, off = lowest, min(depth, highest + 1)  # on the chain at `on`, maybe off at `off`
        while off - on > 1:
            middle = (on + off) // 2
            if history.ancestor_at(conn, head, middle) in chain_depth:
                on = middle
            else:
                off = middle
        child = head if on + 1 == depth else history.ancestor_at(conn, head, on + 1)
        if child in leaving:
            found.setdefault(leaving[child], []).extend(heads[head])
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
