"""Rich output of the replay commands: report tables, the analysis, progress bars.

The library returns typed records (`ReplayReport`, `Analysis`) and takes an
optional `on_step` callback; only this module turns them into text on a
terminal. Figures print as they are in the records' `to_dict()` (the `--json`
contract), so text and JSON never disagree. Unknown counts print "?".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, TaskID, TextColumn
from rich.table import Table

from kvtrace.cli.progress import step_bar, terminal_progress
from kvtrace.inert import inert

if TYPE_CHECKING:
    from kvtrace.replay.analyze import Analysis, ProviderCache
    from kvtrace.replay.engines import EngineFacts
    from kvtrace.replay.report import ReplayReport, StepReport, Totals
    from kvtrace.replay.runs import RunOutcome, RunsReport


def render_replay(report: ReplayReport, console: Console | None = None) -> None:
    """Print a replay report as a plain Rich table, then a one-line summary."""
    from kvtrace.replay.report import ReplayMode

    console = console or Console()
    verify = report.mode is ReplayMode.VERIFY
    table = _report_table(f"{report.mode} {report.run} → {report.target_id[:12]} "
                          f"({report.backend}, {report.model})")
    # "@" is the step's position on the run (RUN@N), tool calls included.
    for name in ("@", "step", "prompt", "reused", "mem/disk", "comp", "hit",
                 "oracle", "pre s", "dec s"):
        table.add_column(name, justify="left" if name == "step" else "right", no_wrap=True)
    if verify:
        table.add_column("ver", justify="left", no_wrap=True)
    for s in report.steps:
        row = [str(s.depth), s.step_id[:7], str(s.prompt_tokens), _n(s.reused_tokens),
               _tiers(s.memory_tokens, s.disk_tokens), _n(s.computed_tokens),
               _pct(s.hit_rate), _pct(s.oracle_hit_rate), f"{s.prefill_s:.2f}",
               f"{s.decode_s:.2f}"]
        if verify:
            row.append(_verdict(s))
        table.add_row(*row)
    t = report.total
    row = ["", "total", str(t.prompt_tokens), _n(t.reused_tokens),
           _tiers(t.memory_tokens, t.disk_tokens), _n(t.computed_tokens), _pct(t.hit_rate),
           _pct(t.oracle_hit_rate), f"{t.prefill_s:.2f}", f"{t.decode_s:.2f}"]
    if verify:
        row.append(f"{t.matching_steps}/{t.steps}")
    table.add_row(*row, style="bold")
    console.print(table)
    summary = (f"{_count(t.steps, 'model call')}, "
               f"{_count(report.tool_steps, 'tool call')} served from the trace, "
               f"{report.wall_s:.2f} s")
    if report.uncached is not None:
        summary += f"; uncached {report.uncached.wall_s:.2f} s, speed-up {report.speedup:.1f}x"
    console.print(summary)
    for line in _oracle_lines(report.engine, t, report.reset):
        console.print(inert(line), markup=False, highlight=False)
    drafts = [s.draft for s in report.steps if s.draft is not None]
    if drafts:
        # Verdicts come from the local engine: kvtrace.engine (and torch) is loaded already.
        from kvtrace.engine.generation import DraftVerdict

        console.print(
            f"drafts: {drafts.count(DraftVerdict.ACCEPTED)} of {len(report.steps)} responses "
            f"checked in one pass, {drafts.count(DraftVerdict.REJECTED)} rejected and decoded "
            "(--no-draft: decode all)"
        )
    for s in report.steps:
        if s.mismatch is not None:
            m = s.mismatch
            console.print(
                inert(f"step @{s.depth} ({s.step_id[:12]}) differs at {m.unit} {m.position}: "
                      f"expected {m.expected_text!r}, got {m.got_text!r}"
                      + (f"; {m.tool_call}" if m.tool_call else "")),
                markup=False, highlight=False,
            )
    if any(s.reused_tokens is None for s in report.steps):
        console.print("?: unknown (the backend does not report cached tokens)")
    counted = _counters_line(report.engine_counters)
    if counted is not None:
        console.print(counted)
    for note in report.notes:
        console.print(inert(f"note: {note}"), markup=False, highlight=False)
    if report.stopped is not None:
        console.print(inert(report.stopped.line()), markup=False, highlight=False)


def _oracle_lines(engine: EngineFacts | None, t: Totals, reset: str | None) -> list[str]:
    """How a remote engine's cache started, what the oracle was counted in, and the oracle
    where a cache can resume when that is short of token-exact: a model's window or state
    layers, a remote engine's whole blocks."""
    lines = [] if reset is None else [f"the engine's cache was emptied first ({reset})"]
    if engine is not None:
        lines.append(f"oracle counted in {engine.tokens or 'no token ids'}; the engine caches "
                     f"in blocks of {engine.block_size} token"
                     f"{'' if engine.block_size == 1 else 's'} ({engine.block_size_from})")
    if t.oracle_resume_tokens is not None and t.oracle_resume_tokens != t.oracle_tokens:
        where = ("the engine's block boundaries" if engine is not None else
                 "the model's resume points (block boundaries of its window or state layers)")
        forced = "the engine" if engine is not None else "the model"
        lines.append(f"oracle at {where}: {_pct(t.oracle_resume_hit_rate)}; the token-exact "
                     f"oracle: {_pct(t.oracle_hit_rate)} (the gap is what {forced} forces, "
                     "not the prompts)")
    return lines


def _counters_line(counters: dict[str, int] | None) -> str | None:
    """The engine's own cache counters over the replay (vLLM's /metrics), LMCache's included."""
    if not counters or not counters.get("queried_tokens"):
        return None
    line = (f"the engine's counters: {counters.get('hit_tokens', 0):,} of "
            f"{counters['queried_tokens']:,} prompt tokens hit its prefix cache")
    if counters.get("external_queried_tokens"):
        served = counters.get("external_hit_tokens", 0)
        line += (f"; its external KV tier (LMCache) served {served:,} of "
                 f"{counters['external_queried_tokens']:,} it was asked for")
    return line


def render_runs(report: RunsReport, console: Console | None = None) -> None:
    """Print a many-run replay: one row per run and the total, then what failed and why."""
    from kvtrace.replay.report import ReplayMode
    from kvtrace.replay.runs import RunStatus

    console = console or Console()
    verify = report.mode is ReplayMode.VERIFY
    table = _report_table(f"{report.mode} of {_count(len(report.runs), 'run')} "
                          f"({report.backend}, {report.model}), concurrency "
                          f"{report.concurrency}")
    for name in ("run", "status", "calls", "prompt", "reused", "comp", "hit", "oracle",
                 "wall s"):
        table.add_column(name, justify="left" if name in ("run", "status") else "right",
                         no_wrap=True)
    if verify:
        table.add_column("ver", justify="right", no_wrap=True)
    for outcome in report.runs:
        row = [_shown(outcome.run), str(outcome.status)]
        if outcome.report is None:
            row += [str(outcome.num_done), "", "", "", "", "", f"{outcome.wall_s:.2f}"]
            if verify:
                row.append("")
        else:
            t = outcome.report.total
            row += [str(t.steps), str(t.prompt_tokens), _n(t.reused_tokens),
                    _n(t.computed_tokens), _pct(t.hit_rate), _pct(t.oracle_hit_rate),
                    f"{outcome.wall_s:.2f}"]
            if verify:
                row.append(f"{t.matching_steps}/{t.steps}")
        table.add_row(*row, style="red" if outcome.status is RunStatus.FAILED else None)
    t = report.total
    row = ["total", "", str(t.steps), str(t.prompt_tokens), _n(t.reused_tokens),
           _n(t.computed_tokens), _pct(t.hit_rate), _pct(t.oracle_hit_rate),
           f"{report.wall_s:.2f}"]
    if verify:
        row.append(f"{t.matching_steps}/{t.steps}")
    table.add_row(*row, style="bold")
    console.print(table)
    failed, differing = report.failed, report.differing
    num_ok = len(report.runs) - len(failed) - len(differing)
    tools = sum(o.report.tool_steps for o in report.runs if o.report is not None)
    console.print(f"{_count(len(report.runs), 'run')}: {num_ok} ok"
                  + (f", {len(differing)} differ" if differing else "")
                  + (f", {len(failed)} failed" if failed else "")
                  + f"; {_count(t.steps, 'model call')}, {_count(tools, 'tool call')} served "
                  f"from the trace; {report.wall_s:.2f} s at concurrency {report.concurrency}")
    for outcome in failed:
        where = f" at @{outcome.failed_at}" if outcome.failed_at is not None else ""
        console.print(inert(f"failed: {outcome.run}{where}: {outcome.error}"),
                      markup=False, highlight=False)
    for outcome in differing:
        steps = outcome.report.steps if outcome.report is not None else []
        first = next(s for s in steps if s.is_match is False)
        console.print(inert(f"differs: {outcome.run} first at step @{first.depth} "
                            f"({first.step_id[:12]})"), markup=False, highlight=False)
    if any(s.reused_tokens is None for o in report.runs if o.report is not None
           for s in o.report.steps):
        console.print("?: unknown (the backend does not report cached tokens)")
    for line in _oracle_lines(report.engine, t, report.reset):
        console.print(inert(line), markup=False, highlight=False)
    counted = _counters_line(report.engine_counters)
    if counted is not None:
        console.print(counted)
    for note in report.notes:
        console.print(inert(f"note: {note}"), markup=False, highlight=False)
    # A note many runs share (no tokenizer, say) is printed once, naming its runs.
    noted: dict[str, list[str]] = {}
    replayed = [o for o in report.runs if o.report is not None]
    for outcome in replayed:
        for note in dict.fromkeys(outcome.report.notes if outcome.report is not None else []):
            noted.setdefault(note, []).append(outcome.run)
    for note, runs in noted.items():
        where = ("" if len(runs) == len(replayed) > 1 else
                 ", ".join(runs[:5]) + (f" and {len(runs) - 5} more" if len(runs) > 5 else "")
                 + ": ")
        console.print(inert(f"note: {where}{note}"), markup=False, highlight=False)


def render_analysis(analysis: Analysis, console: Console | None = None) -> None:
    """Print the per-step oracle bound, the provider's cache and costs, and the prefix breakers.

    Provider columns appear when some call reports usage, cost columns when
    analyze was given prices.
    """
    console = console or Console()
    has_provider = any(s.provider_prompt_tokens is not None for s in analysis.steps)
    costs = analysis.costs
    # "@" is the step's position on the run (RUN@N), tool calls included.
    names = ["@", "step", "prompt", "oracle", "oracle hit", "shared w/ previous"]
    if has_provider:
        names += ["prov. prompt", "cache read", "cache write", "read hit"]
    if costs is not None:
        names += ["billed", "uncached"]
    rows = []
    for s in analysis.steps:
        row = [str(s.depth), s.step_id[:12], str(s.prompt_tokens), str(s.oracle_tokens),
               f"{100 * s.oracle_hit_rate:.1f}%",
               "" if s.shared_with_previous is None else str(s.shared_with_previous)]
        if has_provider:
            row += [_n(s.provider_prompt_tokens), _n(s.provider_cached_tokens),
                    _n(s.provider_cache_write_tokens), _pct(s.provider_hit_rate)]
        if costs is not None:
            row += [_money(s.cost.billed if s.cost else None),
                    _money(s.cost.uncached if s.cost else None)]
        rows.append(row)
    console.print(_fitted_table(
        f"analyze {analysis.spec} → {analysis.target_id[:12]}", names, rows, console,
        droppable=("step", "shared w/ previous", "prov. prompt", "uncached")))
    total = analysis.prompt_tokens
    rate = analysis.oracle_tokens / total if total else 0.0
    console.print(f"oracle bound: {analysis.oracle_tokens}/{total} prompt tokens "
                  f"({100 * rate:.1f}%)")
    provider = analysis.provider
    if provider is not None:
        console.print(
            f"provider cache: read {provider.cached_tokens} of {provider.prompt_tokens} prompt "
            f"tokens ({100 * provider.hit_rate:.1f}%), wrote {_writes(provider)}, on "
            f"the {_calls(provider.num_calls)} that "
            f"{'reports' if provider.num_calls == 1 else 'report'} it; an exact-prefix cache "
            "could have reused "
            f"{100 * provider.oracle_hit_rate:.1f}% (oracle bound, this tokenizer)"
        )
        if provider.note is not None:
            console.print(inert(f"note: {provider.note}"), markup=False, highlight=False)
    if costs is not None:
        line = (f"cost: {_money(costs.billed)} as billed, {_money(costs.uncached)} without the "
                f"cache (saved {_money(costs.saved)}) over the {_calls(costs.num_calls)} priced")
        if costs.unpriced_models:
            line += f"; no price for {', '.join(costs.unpriced_models)}"
        if costs.num_unknown:
            line += f"; {_calls(costs.num_unknown)} without usage"
        console.print(_shown(line), highlight=False)
    for s in analysis.steps:
        if s.context_problem:
            console.print(f"[bold]too long:[/bold] {_shown(s.context_problem)}", highlight=False)
    if not analysis.breakers:
        console.print("no prefix breakers: every prompt extends the previous context")
    depth = {s.index: s.depth for s in analysis.steps}
    for b in analysis.breakers:
        console.print(
            f"[bold]step @{depth[b.index]}[/bold] ({b.step_id[:12]}) breaks the prefix at token "
            f"{b.token_position} (char {b.char_position}), {b.lost_tokens} tokens lost: "
            f"[bold]{_shown(b.cause)}[/bold] — {_shown(b.explanation)}",
            highlight=False,
        )
        console.print(inert(f"    …{b.before!r} | previous: {b.previous!r} | now: {b.current!r}"),
                      highlight=False, markup=False)


@contextmanager
def progress_bar(
    description: str, console: Console | None = None
) -> Iterator[Callable[[int, int, StepReport], None]]:
    """A transient progress bar (`step_bar`) with the hit rate so far; yields the `on_step`
    callback replay and checkout take."""
    with step_bar(description, console=console, columns=[TextColumn("hit {task.fields[hit]}")],
                  hit="-") as update:
        if update is None:
            yield _ignore_step
            return
        bar = update

        def on_step(done: int, total: int, step: StepReport) -> None:
            bar(done, total, hit=_pct(step.hit_rate))

        yield on_step


@contextmanager
def runs_progress(
    num_runs: int, description: str, console: Console | None = None
) -> Iterator[RunBars | None]:
    """Progress of a many-run replay: a bar of runs, and one of steps per run in flight.

    Shown on a terminal only (as `progress_bar`); yields None otherwise.
    """
    progress = terminal_progress(console, [TextColumn("{task.fields[note]}")])
    if progress is None:
        yield None
        return
    with progress:
        yield RunBars(progress, progress.add_task(description, total=num_runs, note=""))


class RunBars:
    """The `RunsProgress` of `replay_runs` as Rich bars (called from its worker threads)."""

    def __init__(self, progress: Progress, runs_task: TaskID) -> None:
        self._progress = progress
        self._runs_task = runs_task
        self._tasks: dict[str, TaskID] = {}
        self._num_failed = 0
        self._lock = threading.Lock()

    def run_started(self, run: str, num_calls: int) -> None:
        task = self._progress.add_task(f"  {_shown(run)}", total=num_calls, note="hit -")
        with self._lock:
            self._tasks[run] = task

    def step_done(self, run: str, done: int, total: int, step: StepReport) -> None:
        with self._lock:
            task = self._tasks.get(run)
        if task is not None:
            self._progress.update(task, completed=done, note=f"hit {_pct(step.hit_rate)}")

    def run_finished(self, outcome: RunOutcome) -> None:
        from kvtrace.replay.runs import RunStatus

        with self._lock:
            task = self._tasks.pop(outcome.run, None)
            self._num_failed += outcome.status is RunStatus.FAILED
            note = f"{self._num_failed} failed" if self._num_failed else ""
        if task is not None:
            self._progress.remove_task(task)
        self._progress.update(self._runs_task, advance=1, note=note)


def _fitted_table(title: str, names: list[str], rows: list[list[str]], console: Console, *,
                  droppable: tuple[str, ...] = ()) -> Table:
    """A compact table that reads at the console's width and never cuts a value: each column
    is as wide as its widest value or its header's longest word (headers wrap at spaces),
    and the `droppable` columns go, in that order, while the table would not fit."""
    widths = [max([len(r[i]) for r in rows] + [max(len(w) for w in names[i].split())])
              for i in range(len(names))]

    def build(keep: list[int]) -> Table:
        table = _report_table(title)
        for i in keep:
            table.add_column(names[i], justify="left" if names[i] == "step" else "right",
                             width=widths[i], overflow="fold")
        for row in rows:
            table.add_row(*(row[i] for i in keep))
        return table

    keep = list(range(len(names)))
    for name in droppable:  # two spaces each, to part the columns and at the edges
        if sum(widths[i] + 2 for i in keep) <= console.width or name not in names:
            continue
        keep.remove(names.index(name))
    return build(keep)


def _report_table(title: str) -> Table:
    """The plain, compact table of a replay report, titled with (recorded, so inert) `title`."""
    return Table(title=_shown(title), title_justify="left", box=box.SIMPLE_HEAD,
                 padding=(0, 1), pad_edge=False, collapse_padding=True)


def _ignore_step(done: int, total: int, step: StepReport) -> None:
    """The progress callback when there is no terminal to show progress on."""


def _verdict(s: StepReport) -> str:
    if s.is_match is None:
        return ""
    if s.is_match:
        return "ok"
    return f"≠@{s.mismatch.position}" if s.mismatch else "≠"


def _tiers(memory: int | None, disk: int | None) -> str:
    return "?" if memory is None or disk is None else f"{memory}/{disk}"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _calls(n: int) -> str:
    return "1 call" if n == 1 else f"{n} calls"


def _n(value: int | None) -> str:
    return "?" if value is None else str(value)


def _money(value: float | None) -> str:
    """A cost in the price list's currency: four decimals (a call often costs under a cent)."""
    return "?" if value is None else f"{value:.4f}"


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.1f}%"


def _shown(text: str) -> str:
    """Recorded text inside Rich markup: inert, and its brackets not read as markup."""
    return escape(inert(text))


def _writes(provider: ProviderCache) -> str:
    """The tokens the provider wrote to its cache: "unknown" where no call says, and on how
    many calls where only some do (never a 0 it did not report)."""
    if provider.cache_write_tokens is None:
        return "unknown"
    if provider.num_write_calls < provider.num_calls:
        return (f"{provider.cache_write_tokens} (on the {provider.num_write_calls} of "
                f"{provider.num_calls} calls that say)")
    return str(provider.cache_write_tokens)
