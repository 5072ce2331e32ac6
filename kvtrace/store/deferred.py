"""The ref moves of a batch's appends, made once per run when the batch has done its work.

An import appends tens to thousands of steps to one run inside one
transaction (`Store.batch`). Moved one append at a time, a run's ref costs
each append three statements (the compare-and-swap, the paused-run check,
the reflog row; on PostgreSQL a NOTIFY too): more than writing the step.
Nothing outside the batch sees a move before it commits, so the moves can
wait: `DeferredMoves` keeps, per run, where the batch found its head and
where the appends have taken it, and `flush` then swaps each run's head
once (`refs.move_refs`) and writes the reflog rows, one per append as
always, in one statement.

What a move guarantees still holds, checked by the swap when the batch
flushes: a run that another writer moved meanwhile fails the swap
(ConflictError: the batch writes nothing), a paused run refuses the batch
(RunPausedError), and every append has its reflog row, in order. A batch
flushes before any other write it makes (a fork, a new run), so those see
the heads its appends left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection

from kvtrace.errors import ConflictError
from kvtrace.store.refs import move_refs, reflog_row


@dataclass(slots=True)
class _Run:
    first: str | None  # the head the batch found
    last: str | None  # where its appends have taken it
    rows: list[dict[str, Any]] = field(default_factory=list)  # reflog rows, one per append


class DeferredMoves:
    """Appends' ref moves held by a batch (one writer thread: the batch's)."""

    def __init__(self) -> None:
        self._runs: dict[str, _Run] = {}

    def append(self, name: str, old: str | None, new: str, message: str) -> None:
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
        run.rows.append(reflog_row(name, old, new, "append", message, time.time()))

    def flush(self, conn: Connection) -> None:
        """Swap each run's head once and write the reflog rows, in `conn`'s transaction."""
        runs, self._runs = self._runs, {}
        for name, run in runs.items():
            move_refs(conn, name, run.first, run.last, run.rows)
