"""Views over history that compare runs: where they part, where they branch.

Both take chains of step ids already walked by `history.chain` and read only
what they show, in the caller's read transaction.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from kvtrace.store.db.schema import refs, steps
from kvtrace.store.objects import history
from kvtrace.store.records import Divergence, GraphRow

# The runs taking the branches that leave a chain are found by walking down
# from each branch; past this many steps below them, or this many runs, they
# go unnamed (the branches are still counted).
MAX_STEPS_BELOW = 20_000
MAX_RUNS_TO_NAME = 200


def graph_rows(conn: Connection, chain: list[str]) -> list[GraphRow]:
    """Each step of `chain`, the runs whose head it is, and the branches (and runs) leaving it.

    Reads only what the chain reaches: the refs whose head is on it
    (`ix_refs_head`), the steps whose parent is on it (`ix_steps_parent_id`)
    and the steps below those, never every run of the store.
    """
    heads: dict[str, list[str]] = {}
    for part in history.chunks(chain):
        for name, head in conn.execute(
            sa.select(refs.c.name, refs.c.head).where(refs.c.head.in_(part))
        ):
            heads.setdefault(head, []).append(name)
    leaving, num_branches = _leaving(conn, chain)
    loaded = history.load_steps(conn, chain)
    runs = _runs_taking(conn, leaving)
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
    leaving, _ = _leaving(conn, chain)
    runs = _runs_taking(conn, leaving) or {}
    depth: dict[str, int] = {}
    for part in history.chunks(list(runs)):
        depth.update((step_id, at) for step_id, at in conn.execute(
            sa.select(steps.c.id, steps.c.depth).where(steps.c.id.in_(part))))
    return sorted(((run, depth[step_id]) for step_id, names in runs.items() for run in names),
                  key=lambda fork: (fork[1], fork[0]))


def _leaving(conn: Connection, chain: list[str]) -> tuple[dict[str, str], dict[str, int]]:
    """The steps off `chain` whose parent is on it (each mapped to that parent), and the
    number of such branches at each chain step; read through `ix_steps_parent_id`."""
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
    return leaving, num_branches


def _runs_taking(conn: Connection, leaving: dict[str, str]) -> dict[str, list[str]] | None:
    """For each chain step with branches, the runs that take one: those whose head is at or
    below a branch's first step (`leaving` maps it to the chain step it leaves).

    The steps below the branches are walked down the parent index; None when
    there are more than MAX_STEPS_BELOW of them or more than MAX_RUNS_TO_NAME runs.
    """
    if not leaving:
        return {}
    below: dict[str, str] = {}  # a step at or below a branch -> the chain step it leaves
    for part in history.chunks(list(leaving)):
        walk = (
            sa.select(steps.c.id, steps.c.id.label("branch"))
            .where(steps.c.id.in_(part))
            .cte("below", recursive=True)
        )
        walk = walk.union_all(
            sa.select(steps.c.id, walk.c.branch).join(walk, steps.c.parent_id == walk.c.id)
        )
        budget = MAX_STEPS_BELOW - len(below) + 1  # one more tells that there are too many
        for step_id, branch in conn.execute(sa.select(walk.c.id, walk.c.branch).limit(budget)):
            below[step_id] = leaving[branch]
        if len(below) > MAX_STEPS_BELOW:
            return None
    found: dict[str, list[str]] = {}
    num_runs = 0
    for part in history.chunks(list(below)):
        for name, head in conn.execute(
            sa.select(refs.c.name, refs.c.head).where(refs.c.head.in_(part))
        ):
            found.setdefault(below[head], []).append(name)
            num_runs += 1
    return None if num_runs > MAX_RUNS_TO_NAME else found


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
