"""The progress bar of long commands (import, export, report, replay): on a terminal only.

A transient Rich bar on stderr: the command's output (stdout) stays clean,
and when stderr is not a terminal (a pipe, a file, a CI log) nothing is
drawn, so stderr stays free for the one-line error a failure prints (a
transient bar would still leave a blank line). The library takes an
`on_step(done, total)` callback (`kvtrace.store.OnStep`); this module is
the only one that draws it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

# (done, total, **fields): moves the bar; fields are the extra columns' values.
Update = Callable[..., None]


def terminal_progress(console: Console | None = None,
                      columns: Sequence[ProgressColumn] = ()) -> Progress | None:
    """Transient bars (description, bar, M/N, `columns`, time) on stderr; None off a terminal."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    *columns, TimeElapsedColumn(), console=console, transient=True)


@contextmanager
def step_bar(description: str, *, console: Console | None = None,
             columns: Sequence[ProgressColumn] = (), **fields: Any) -> Iterator[Update | None]:
    """A transient bar of steps done out of a total; yields its update, or None off a terminal."""
    progress = terminal_progress(console, columns)
    if progress is None:
        yield None
        return
    task = progress.add_task(description, total=None, **fields)

    def update(done: int, total: int, **changed: Any) -> None:
        progress.update(task, completed=done, total=total, **changed)

    with progress:
        yield update
