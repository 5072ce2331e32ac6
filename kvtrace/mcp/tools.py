"""The MCP tools: each one call of kvtrace's public Python API, returning its JSON.

A tool returns the document its CLI twin prints with `--json` (`list_runs`
is `kvtrace runs`, `show_step` is `kvtrace show`, ...), wrapped in an
object where the CLI prints a list (MCP's structured results are objects),
with step content fitted to a page (paging.py). Tools without a CLI twin
(`watch`, `pause`, `resume`, a `fork` with an edit) return what the API
gives, in the same style: a move or a pause is its reflog entry.

Arguments are named as the API and the CLI name them (`run`, `spec`, `to`,
`n`, ...), so that an error about one names it (results.py). Limits that
the API does not check itself (a page size, a watch's timeout) are checked
here, before anything is read.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal

from pydantic import Field

from kvtrace.errors import UsageError
from kvtrace.mcp.models import Models
from kvtrace.mcp.paging import (
    DEFAULT_MAX_BYTES,
    MAX_MAX_BYTES,
    MIN_MAX_BYTES,
    Budget,
    read_page,
    step_document,
)
from kvtrace.replay import SamplingParams, StepReport, branch_out
from kvtrace.replay import analyze as analyze_run
from kvtrace.replay import replay as replay_run
from kvtrace.replay.tools import DEMO_TOOLS
from kvtrace.store import Store
from kvtrace.store.kinds import edit_of
from kvtrace.store.present.compare import compare
from kvtrace.store.records import ReflogEntry
from kvtrace.store.watch import WatchEvent
from kvtrace.workspace.verdicts import runs_by_verdict

MAX_WATCH_S = 300.0
WATCH_POLL_S = 0.05  # SQLite: how often a waiting watch looks (PostgreSQL is woken by NOTIFY)

Run = Annotated[str, Field(description="A run (branch) name.")]
Spec = Annotated[str, Field(
    description="A step address: RUN (its head), RUN@N (its Nth step, from 1), RUN~K (K steps "
    "before its head) or a step-id prefix.")]
MaxBytes = Annotated[int, Field(
    description=f"Page size: the most bytes of step content the result holds "
    f"({DEFAULT_MAX_BYTES} by default, {MIN_MAX_BYTES} to {MAX_MAX_BYTES}). A content field "
    "left out is listed under its step's `paged`, with the pointer that reads it (show_step).")]
Edit = Annotated[dict[str, Any] | None, Field(
    description='Content fields of the step to replace, e.g. {"result": ...} for a tool call, '
    '{"response": ...} or {"messages": [...]} for a model call: the fork starts from an edited '
    "copy of the step (the original stays as it was).")]


class Tools:
    """The tools of `kvtrace mcp`, over one store (and the model the replay tools load)."""

    def __init__(self, store: Store, models: Models) -> None:
        self.store = store
        self.models = models

    # -- reading -------------------------------------------------------------------------

    def list_runs(
        self,
        verdict: Annotated[Literal["passed", "failed", "none"] | None, Field(
            description="Only runs whose latest verdict (record --verify, kvtrace verify) "
            "passed, failed, or that have none; each then has its `verdict`.")] = None,
    ) -> dict[str, Any]:
        """Every run (branch): its name, head step id, number of steps and creation time.

        Same as `kvtrace runs --json` (`--verdict`), under `runs`."""
        infos = self.store.runs()
        if verdict is None:
            return {"runs": [info.to_dict() for info in infos]}
        graded = runs_by_verdict(self.store, [info.name for info in infos], verdict)
        return {"runs": [{**info.to_dict(), "verdict": graded[info.name]}
                         for info in infos if info.name in graded]}

    def log(
        self,
        run: Annotated[str, Field(description="A run, or any step address to start from.")],
        limit: Annotated[int, Field(description="At most this many steps (1 or more).")] = 20,
        graph: Annotated[bool, Field(
            description="Also give, per step, the runs whose head it is and the branches "
            "(forks) leaving it.")] = False,
        max_bytes: MaxBytes = DEFAULT_MAX_BYTES,
    ) -> dict[str, Any]:
        """Steps from a run's head back toward its root, newest first (`kvtrace log --json`).

        `remaining_steps` counts the older steps not listed; pass `next` as `run` to go on."""
        if limit < 1:
            raise UsageError(f"limit={limit}: list at least 1 step", param="limit")
        budget = Budget(max_bytes)
        if graph:
            rows = self.store.graph(run, limit=limit)
            steps = [{**step_document(row.step, budget), "heads": row.heads,
                      "num_branches": row.num_branches, "branch_runs": row.branch_runs}
                     for row in rows]
            last = rows[-1].step if rows else None
        else:
            found = list(self.store.log(run, limit=limit))
            steps = [step_document(step, budget) for step in found]
            last = found[-1] if found else None
        remaining = last.depth - 1 if last is not None else 0
        return {"steps": steps, "remaining_steps": remaining,
                "next": last.parent_id if last is not None and remaining else None}

    def show_step(
        self,
        spec: Spec,
        pointer: Annotated[str | None, Field(
            description="A JSON pointer into the step's content, e.g. /messages or "
            "/messages/3/content: read that value in pages instead of the whole step.")] = None,
        offset: Annotated[int, Field(
            description="With a pointer: where the page starts (an item index in a list, a "
            "byte offset in text); pass the last page's next_offset.")] = 0,
        max_bytes: MaxBytes = DEFAULT_MAX_BYTES,
    ) -> dict[str, Any]:
        """One step: its metadata, content and notes (`kvtrace show --json`), or one page of a
        value in it.

        Without `pointer`, content fields that do not fit `max_bytes` are listed under `paged`;
        with it, the value comes in pages: list items from `offset`, or text from byte
        `offset`, with `next_offset` and what remains (`remaining_bytes`, `remaining_items`)."""
        budget = Budget(max_bytes)
        if offset < 0 or (offset and not pointer):
            raise UsageError(f"offset={offset}: " + ("an offset is 0 or more" if offset < 0 else
                             "an offset pages a value: name it with pointer"), param="offset")
        step = self.store.show(spec)
        if not pointer:
            return step_document(step, budget, notes=self.store.notes(step.id))
        return read_page(step, pointer, offset, max_bytes)

    def watch(
        self,
        run: Run,
        cursor: Annotated[int | None, Field(
            description="Events after this one: the `cursor` a watch (or an event) returned; 0 "
            "for the run's whole history; omitted: from now on.")] = None,
        timeout: Annotated[float, Field(
            description=f"Seconds to wait for an event when none is there yet (0 to "
            f"{MAX_WATCH_S:g}).")] = 10.0,
        max_events: Annotated[int, Field(description="At most this many events.")] = 100,
        max_bytes: MaxBytes = DEFAULT_MAX_BYTES,
    ) -> dict[str, Any]:
        """The next events of a run after a cursor: steps appended, moves (revert, reset,
        fork), pauses and resumes, from any process, in order, none twice.

        Returns the events already there (up to `max_events`), else the first one to come,
        as soon as it comes, or none after `timeout` seconds. Pass the returned `cursor` to
        the next call: nothing falls between two calls."""
        if not 0 <= timeout <= MAX_WATCH_S:  # NaN too
            raise UsageError(f"timeout={timeout}: wait from 0 to {MAX_WATCH_S:g} seconds",
                             param="timeout")
        if max_events < 1:
            raise UsageError(f"max_events={max_events}: ask for at least 1 event",
                             param="max_events")
        if cursor is not None and cursor < 0:
            raise UsageError(f"cursor={cursor}: a cursor is 0 or more", param="cursor")
        budget = Budget(max_bytes)
        start = self.store.watch_cursor(run) if cursor is None else cursor
        events = self._next_events(run, start, timeout, max_events)
        return {
            "run": run,
            "events": [_event_document(event, budget) for event in events],
            "cursor": events[-1].cursor if events else start,
            "is_paused": self.store.is_paused(run),
        }

    def _next_events(self, run: str, since: int, timeout: float, limit: int) -> list[WatchEvent]:
        """The events after `since` that are there already, else the first one to come
        within `timeout` (the next call gets those behind it: none is lost)."""
        with _watching(self.store, run, since, 0) as ready:
            events = list(itertools.islice(ready, limit))
        if events or not timeout:
            return events
        # Returning at the first event keeps its latency to the store's own (PostgreSQL:
        # a NOTIFY; SQLite: a poll), not that of another read after it.
        with _watching(self.store, run, since, timeout) as waiting:
            first = next(waiting, None)
        return [first] if first is not None else []

    def diff(self, a: Spec, b: Spec, max_bytes: MaxBytes = DEFAULT_MAX_BYTES) -> dict[str, Any]:
        """Where two runs (or steps) part, and field by field what differs at the first step
        whose content differs (`kvtrace diff --json`)."""
        budget = Budget(max_bytes)
        result = compare(self.store, a, b)
        document = result.to_dict()
        first = document["first_difference"]
        parted = result.divergence
        # The differing pair first: when the budget runs short, they keep their content.
        for holder, key, step in ((first, "a", result.step_a), (first, "b", result.step_b),
                                  (document, "first_a", parted.first_a),
                                  (document, "first_b", parted.first_b),
                                  (document, "common", parted.common)):
            holder[key] = step_document(step, budget) if step is not None else None
        return document

    def analyze(self, run: Spec) -> dict[str, Any]:
        """The oracle bound per model call and the prefix breakers, with the tokenizer only
        (`kvtrace analyze --json`): where and why prompts stop sharing a prefix."""
        with self.models.tokenizer() as tokenizer:
            return analyze_run(self.store, run, tokenizer).to_dict()

    # -- supervising ---------------------------------------------------------------------

    def note(
        self,
        spec: Spec,
        text: Annotated[str, Field(description="The note.")],
        author: Annotated[str | None, Field(description="Who wrote it.")] = None,
    ) -> dict[str, Any]:
        """Attach a note to a step; the step itself never changes (`kvtrace note --json`)."""
        return self.store.note(spec, text, author=author).to_dict()

    def pause(
        self,
        run: Run,
        reason: Annotated[str, Field(description="Why (kept in the run's reflog).")]
        = "paused by a supervisor",
    ) -> dict[str, Any]:
        """Pause a run: until `resume`, every append to it fails, writing nothing, and its
        writer waits or stops. Returns the pause's reflog entry."""
        self.store.pause(run, reason=reason)
        return self._last_move(run)

    def resume(
        self,
        run: Run,
        reason: Annotated[str, Field(description="Why (kept in the run's reflog).")]
        = "resumed",
    ) -> dict[str, Any]:
        """Let appends to a paused run go on again. Returns the resume's reflog entry."""
        self.store.resume(run, reason=reason)
        return self._last_move(run)

    def revert(
        self,
        run: Run,
        to: Annotated[str, Field(description="An earlier step of that run (RUN@N, RUN~K, id).")],
    ) -> dict[str, Any]:
        """Move a run back to an earlier step (`kvtrace revert --json`: the move's reflog entry).

        The reverted steps stay in the store and the reflog; `undo` brings them back. A writer
        still appending after the old head gets a conflict and writes nothing."""
        self.store.revert(run, to=to)
        return self._last_move(run)

    def undo(self, run: Run) -> dict[str, Any]:
        """Undo the last revert, reset, append or import of a run, from its reflog (`kvtrace undo
        --json`: the undo's reflog entry)."""
        self.store.undo(run)
        return self._last_move(run)

    def fork(
        self,
        spec: Annotated[str, Field(description="The step to fork at (RUN, RUN@N, RUN~K, id).")],
        new: Annotated[str, Field(description="Name of the new run.")],
        edit: Edit = None,
    ) -> dict[str, Any]:
        """Start a new run at any step of any run, O(1), nothing copied (`kvtrace fork --json`);
        with `edit`, at an edited copy of that step (`edit_of` names the original)."""
        forked = self.store.fork(spec, new, edit=edit)
        head = forked.head
        return {"run": forked.name, "head": head.id if head else None,
                "depth": head.depth if head else 0, "forked_from": spec,
                "edit_of": edit_of(head) if head is not None else None}

    def _last_move(self, run: str) -> dict[str, Any]:
        """The reflog entry of what was just done to `run`, as the CLI prints it."""
        entry: ReflogEntry = self.store.reflog(run)[0]
        return entry.to_dict()

    # -- computing with the model --------------------------------------------------------

    def replay(
        self,
        run: Annotated[str, Field(description="The run (or any step address) to replay.")],
        mode: Annotated[Literal["rebuild", "verify"], Field(
            description="rebuild: feed the recorded outputs, rebuilding the KV state fast; "
            "verify: regenerate each response and report where it first differs.")]
        = "rebuild",
        to: Annotated[str | None, Field(
            description="Stop at this step of the run (default: its head).")] = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Replay a run from its root through the server's model, reusing the KV cache of
        every matching prefix (`kvtrace replay --json`): per model call and in total, prompt
        tokens reused and computed, the hit rate against the oracle bound, and (verify) the
        first step and token where the response differs. Sends progress (model calls
        replayed of all) to a client that asks for it."""

        def on_step(done: int, total: int, step: StepReport) -> None:
            if on_progress is not None:
                on_progress(done, total)

        with self.models.backend() as backend:
            return replay_run(self.store, run, backend, to=to, mode=mode,
                              on_step=on_step).to_dict()

    def branch(
        self,
        spec: Spec,
        n: Annotated[int, Field(description="How many branches (runs) to fork and continue.")],
        steps: Annotated[int, Field(description="At most this many model calls per branch.")]
        = 3,
        temperature: Annotated[float, Field(description="Sampling temperature.")] = 0.7,
        seed: Annotated[int, Field(description="Branch i samples with seed + i - 1.")] = 0,
        edit: Edit = None,
        prefix: Annotated[str | None, Field(
            description="Branch runs are named PREFIX-1, ... (default: RUN-branch).")] = None,
        tools: Annotated[Literal["none", "demo"], Field(
            description="none: a tool call stops a branch, naming the tool; demo: the "
            "deterministic calculator and lookup tools of kvtrace's examples.")] = "none",
        max_new_tokens: Annotated[int, Field(description="Tokens per response.")] = 96,
    ) -> dict[str, Any]:
        """Fork N runs from one step (optionally edited) and continue each with the server's
        model, sharing the prefix's KV; compare where they diverge (`kvtrace branch --json`)."""
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        with self.models.backend() as backend:
            return branch_out(self.store, spec, backend, n=n, prefix=prefix, steps=steps,
                              tools=dict(DEMO_TOOLS) if tools == "demo" else {},
                              params=params, seed=seed, edit=edit).to_dict()

    def methods(self) -> list[Any]:
        """Every tool method, in the order clients list them."""
        return [self.list_runs, self.log, self.show_step, self.watch, self.diff, self.analyze,
                self.note, self.pause, self.resume, self.revert, self.undo, self.fork,
                self.replay, self.branch]


READ_ONLY = frozenset({"list_runs", "log", "show_step", "watch", "diff", "analyze"})


def _event_document(event: WatchEvent, budget: Budget) -> dict[str, Any]:
    document = event.to_dict()
    if event.step is not None:
        document["step"] = step_document(event.step, budget)
    return document


@contextmanager
def _watching(store: Store, run: str, since: int, timeout: float) -> Iterator[Iterator[WatchEvent]]:
    """`Store.watch`, closed on leaving: a PostgreSQL watch ends its LISTEN connection at once."""
    events = store.watch(run, since=since, timeout=timeout, poll_interval=WATCH_POLL_S)
    try:
        yield events
    finally:
        close = getattr(events, "close", None)  # a generator's
        if callable(close):
            close()
