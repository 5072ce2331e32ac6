"""The ref moves of a batch's appends, made once per run when the batch has done its work.

An import appends tens to thousands of steps to one run inside one
transaction (`Store.batch`). Moved one append at a time, a run's ref costs
each append three statements (the compare-and-swap, the paused-run check,
the reflog row; on PostgreSQL a NOTIFY too): more than writing the step.
Nothing outside the batch sees a move before it commits, so the moves can
wait: `BatchedMoves` keeps, per run, where the batch found its head and
where the appends have taken it, and `flush` then swaps each run's head
once (`refs.move_refs`) with one reflog entry, reason `batch`, from where
the batch found the run to where it left it: an import is one operation, as
`git fetch` writes one reflog entry per ref it moves, however many commits
it brings. `undo` of that entry moves the run back to where the batch found
it; the steps in between are each other's parents, so the run's log still
shows every one, and the entry's message counts them by kind. (One entry
per append cost an import a reflog row and an index entry per step, a
quarter of the store's bytes besides the content: docs/benchmarks.md.)

What a move guarantees still holds, checked by the swap when the batch
flushes: a run that another writer moved meanwhile fails the swap
(ConflictError: the batch writes nothing), a paused run refuses the batch
(RunPausedError), and every move of a run has its reflog entry. A batch
flushes before any other write it makes (a fork, a new run), so those see
the heads its appends left.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection

from kvtrace.errors import ConflictError
from kvtrace.store.objects.refs import move_refs


@dataclass(slots=True)
class _Run:
    first: str | None  # the head the batch found
    last: str | None  # where its appends have taken it
    kinds: Counter[str] = field(default_factory=Counter)  # the appends' step kinds


def batch_message(kinds: Counter[str]) -> str:
    """The reflog message of a batch's appends to one run: how many steps of each kind."""
    total = sum(kinds.values())
    counted = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    return f"{total} step{'s' if total != 1 else ''} appended in one batch: {counted}"


class BatchedMoves:
    """Appends' ref moves held by a batch (one writer thread: the batch's)."""

    def __init__(self) -> None:
        self._runs: dict[str, _Run] = {}

    def append(self, name: str, old: str | None, new: str, kind: str) -> None:
        """An append moved run `name` from `old` to `new` (ConflictError if the batch's
        earlier appends left it elsewhere: that writer lost track of its run)."""
        run = self._runs.get(name)
        if run is None:
            run = self._runs[name] = _Run(old, old)
        if run.last != old:
            raise ConflictError(
                f"run {name!r} moved to {str(run.last)[:12]} while this writer expected "
                f"{str(old)[:12]}: reload the run (Store.run) and try again")
        run.last = new
        run.kinds[kind] += 1

    def flush(self, conn: Connection) -> None:
        """Swap each run's head once and log the move, in `conn`'s transaction."""
        runs, self._runs = self._runs, {}
        for name, run in runs.items():
            move_refs(conn, name, run.first, run.last, batch_message(run.kinds))
