"""Store commands: init, runs, log, show, fork, revert, reset, undo, reflog,
note, fsck, export, import, diff. Each is one call of the `kvtrace.store` API (import
and export: of `kvtrace.formats`, which also reads and writes bundles). With `--json`,
a command that changes something prints what it did: the new run, the reflog entry of
the move, the note, the imported run, the written file."""

from __future__ import annotations

import datetime
import enum
import io
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtrace.cli.app import Json, app, print_json, print_json_items, read_edit, say, store_url
from kvtrace.cli.output import Force, output_file
from kvtrace.cli.progress import step_bar
from kvtrace.errors import UsageError
from kvtrace.formats import Format, export_file, import_file, subagent_runs
from kvtrace.store import ReflogEntry, RunInfo, Store, import_into, init_store, open_store
from kvtrace.store.kinds import CUT_NOTE, edit_of, is_cut
from kvtrace.store.present.compare import compare
from kvtrace.store.present.shown import MAX_SHOWN, shown_value
from kvtrace.store.present.summary import step_summary


def _store(ctx: typer.Context) -> Store:
    """The existing store; only `init` and a successful `import` create one."""
    return open_store(store_url(ctx), create=False)


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).isoformat(timespec="seconds")


def _last_move(store: Store, run: str) -> ReflogEntry:
    """The reflog entry of the move just made on `run` (what --json prints)."""
    return store.reflog(run, limit=1)[0]


@app.command()
def init(
    ctx: typer.Context,
    force: Annotated[bool, typer.Option(
        "--force", help="Create the store even in a database that holds other tables.")] = False,
    as_json: Json = False,
) -> None:
    """Create the store (if missing) and print where it is."""
    with init_store(store_url(ctx), force=force) as store:
        url = store.display_url
    if as_json:
        print_json({"store": url})
        return
    say(f"kvtrace store ready at {url}")


class VerdictFilter(enum.StrEnum):
    """`runs --verdict`: a run's latest verdict, or none."""

    PASSED = "passed"
    FAILED = "failed"
    NONE = "none"


@app.command()
def runs(
    ctx: typer.Context,
    limit: Annotated[int | None, typer.Option(
        "--limit", "-n", help="Show at most this many runs (a page).")] = None,
    after: Annotated[str | None, typer.Option(
        "--after", help="Start after this run name (the last one of the previous page).")] = None,
    verdict: Annotated[VerdictFilter | None, typer.Option(
        "--verdict", help="Only runs whose latest verdict (record --verify, kvtrace verify) "
        "passed, failed, or that have none; shows each run's verdict.")] = None,
    as_json: Json = False,
) -> None:
    """List runs (branches) by name with their head and length."""
    from kvtrace.workspace.verdicts import runs_by_verdict

    if limit is not None and limit < 1:
        raise UsageError("--limit must be at least 1")
    with _store(ctx) as store:
        infos = store.runs(limit=limit, after=after)
        graded = (runs_by_verdict(store, [info.name for info in infos], verdict.value)
                   if verdict is not None else None)
    if graded is not None:
        infos = [info for info in infos if info.name in graded]
    if as_json:
        print_json([{**info.to_dict(), **({"verdict": graded[info.name]} if graded else {})}
                    for info in infos])
        return
    for info in infos:
        head = info.head_id[:12] if info.head_id else "(empty)"
        shown = f" {graded[info.name] or '-'}" if graded is not None else ""
        say(f"{info.name:30} {head:12} {info.depth:6} steps{shown}")





@app.command()
def log(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(
        help="A run, or any step address (RUN@N, RUN~K, id).")],
    graph: Annotated[bool, typer.Option(
        "--graph", help="Mark runs pointing here and forks.")] = False,
    limit: Annotated[int | None, typer.Option(
        "--limit", "-n", help="Show at most this many steps.")] = None,
    as_json: Json = False,
) -> None:
    """Show steps from the head back to the root, like `git log`."""
    if limit is not None and limit < 1:
        raise UsageError("--limit must be at least 1")
    with _store(ctx) as store:
        if not graph:
            # Printed as read, a page of steps at a time: a long run's first lines come at
            # once, and memory holds one page, not every step's history.
            if as_json:
                print_json_items(s.to_dict() for s in store.log(run, limit=limit))
                return
            steps = store.log(run, limit=limit, lists=False)  # a line needs no conversation
            shown = 0
            width = shutil.get_terminal_size().columns
            for s in steps:
                say(_fitted(f"{s.depth:4} {s.short_id} {s.kind:10} {step_summary(s)}", width))
                shown += 1
            if not shown:
                say(f"{run} has no steps yet")
            return
        rows = store.graph(run, limit=limit)
    if as_json:
        print_json([row.to_dict() for row in rows])
        return
    if not rows:
        say(f"{run} has no steps yet")
    for row in rows:
        s = row.step
        refs = f" ({', '.join(row.heads)})" if row.heads else ""
        say(_fitted(f"* {s.depth:4} {s.short_id}{refs} {s.kind:10} {step_summary(s)}",
                    shutil.get_terminal_size().columns))
        if row.num_branches:
            say(f"|\\  {_branches(row.num_branches, row.branch_runs)}")


def _branches(num_branches: int, runs: list[str] | None) -> str:
    """'exp leaves this step', '2 other branches leave this step (runs: a, b)', …"""
    if num_branches == 1 and runs is not None and len(runs) == 1:
        return f"{runs[0]} leaves this step"
    which = "1 other branch leaves" if num_branches == 1 else (
        f"{num_branches} other branches leave")
    if runs is None:
        return f"{which} this step (see `kvtrace runs`)"
    return f"{which} this step" + (f" (runs: {', '.join(runs)})" if runs else "")


def _diff_files(ctx: typer.Context, a: str, b: str, *, as_json: bool) -> None:
    from kvtrace.workspace.steps import file_diff

    with _store(ctx) as store:
        found = file_diff(store, a, b)
    if as_json:
        print_json(found.to_dict())
        return
    say(f"files from {a} ({found.a.short_id}) to {b} ({found.b.short_id}): "
        + (f"{len(found.changes)} changed" if found.changes else "the same"))
    for change in found.changes:
        say(f"  {change.status:<7} {change.path}")
    for change in found.changes:
        if found.diffs.get(change.path):
            say("\n".join(found.diffs[change.path]))


@app.command()
def diff(
    ctx: typer.Context,
    a: Annotated[str, typer.Argument(help="A run or step address.")],
    b: Annotated[str, typer.Argument(help="Another run or step address.")],
    files: Annotated[bool, typer.Option(
        "--files", help="The files added, removed and changed between the two steps' "
        "workspace snapshots (record --workspace), with a diff of each text file.")] = False,
    as_json: Json = False,
) -> None:
    """Where two runs part, and what differs at the first step whose content differs."""
    if files:
        _diff_files(ctx, a, b, as_json=as_json)
        return
    with _store(ctx) as store:
        result = compare(store, a, b)
    if as_json:
        print_json(result.to_dict())
        return
    parted = result.divergence
    common = parted.common
    say(
        f"common: {common.depth} {common.short_id} {common.kind}" if common
        else "common: (none): unrelated runs, aligned step by step from the root"
    )
    for label, step, count in ((a, parted.first_a, parted.num_only_a),
                               (b, parted.first_b, parted.num_only_b)):
        if step is None:
            say(f"{label}: no steps after the common one")
        else:
            say(f"{label}: {count} more step(s), first {step.short_id} {step.kind} "
                       f"{step_summary(step)}")
    if result.is_same_content:
        say("same content at every position (only ids, timings or usage differ)")
        return
    say(f"first difference at @{result.position}"
               + (f" (after {result.num_same_content} step(s) that differ only in timings or "
                  "usage)" if result.num_same_content else "") + ":")
    for label, step in ((a, result.step_a), (b, result.step_b)):
        shown = (f"{step.short_id} {step.kind} {step_summary(step)}" if step
                 else "(no step here: the run ends before)")
        copied = edit_of(step) if step is not None else None
        if copied is not None:
            shown += f" [edited copy of {copied[:12]}]"
        say(f"  {label}@{result.position}: {shown}")
    for change in result.changes:  # each diff names its field in its --- and +++ lines
        say("\n".join(change.diff or [f"{change.field}: differs"]))


@app.command()
def show(
    ctx: typer.Context,
    spec: Annotated[str, typer.Argument(
        help="Step address: RUN, RUN@N, RUN~K or id prefix.")],
    full: Annotated[bool, typer.Option(
        "--full", help=f"Show every value whole (by default one longer than {MAX_SHOWN:,} "
        "characters is cut, saying how much; --json is always whole).")] = False,
    as_json: Json = False,
) -> None:
    """Show one step: its metadata, content and notes."""
    with _store(ctx) as store:
        step = store.show(spec)
        notes = store.notes(step.id)
    if as_json:
        print_json({**step.to_dict(), "notes": [n.to_dict() for n in notes]})
        return
    say(f"step   {step.id}")
    say(f"parent {step.parent_id}")
    say(f"kind   {step.kind}   depth {step.depth}   recorded {_when(step.recorded_at)}")
    if is_cut(step):
        say(f"{CUT_NOTE}: never served as an answer (--from and replay ask the model here)")
    num_cut = 0

    def text(value: Any, **dumps: Any) -> str:
        nonlocal num_cut
        if not full:
            value, cut = shown_value(value)
            num_cut += cut
        return json.dumps(value, ensure_ascii=False, **dumps)

    for key, value in step.meta.items():
        say(f"{key}: {text(value)}")
    for key, value in step.to_dict()["content"].items():
        say(f"--- {key}")
        say(text(value, indent=2))
    for note in notes:
        say(f"note ({note.author or 'anonymous'}, {_when(note.created_at)}): {note.text}")
    if num_cut:
        say(f"{num_cut} value(s) cut at {MAX_SHOWN:,} characters: kvtrace show --full {spec} "
            "shows them whole")


@app.command()
def fork(
    ctx: typer.Context,
    spec: Annotated[str, typer.Argument(help="Step to fork at.")],
    new: Annotated[str, typer.Argument(help="Name of the new run.")],
    edit: Annotated[str | None, typer.Option(
        "--edit",
        help="A JSON file mapping the step's content fields to new values (e.g. "
        '{"result": "..."} for a tool call): the new run ends on an edited copy.')] = None,
    as_json: Json = False,
) -> None:
    """Start a new run at any step of any run (O(1): nothing is copied), or at an edited
    copy of that step (--edit)."""
    changes = read_edit(edit) if edit is not None else None
    with _store(ctx) as store:
        run = store.fork(spec, new, edit=changes)
    head = run.head
    if as_json:
        print_json({"run": run.name, "head": head.id if head else None,
                    "depth": head.depth if head else 0, "forked_from": spec})
        return
    say(f"forked {run.name} at {head.short_id if head else '(empty)'}")


@app.command()
def revert(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="Run to move back.")],
    to: Annotated[str, typer.Option("--to", help="An earlier step of that run.")],
    as_json: Json = False,
) -> None:
    """Move a run back to an earlier step; the reverted steps stay in the reflog."""
    with _store(ctx) as store:
        step = store.revert(run, to=to)
        moved = _last_move(store, run)
    if as_json:
        print_json(moved.to_dict())
        return
    say(
        f"{run} reverted to {step.short_id} (depth {step.depth}); undo with `kvtrace undo {run}`"
    )


@app.command()
def reset(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="Run to move.")],
    to: Annotated[str | None, typer.Option(
        "--to",
        help="Any step (e.g. a reverted head). Default: the head the run's reflog last "
        "recorded, which restores a run deleted or moved behind kvtrace's back.")] = None,
    as_json: Json = False,
) -> None:
    """Move a run to any step (this is how a revert is undone)."""
    with _store(ctx) as store:
        step = store.reset(run, to=to)
        moved = _last_move(store, run)
    if as_json:
        print_json(moved.to_dict())
        return
    say(f"{run} reset to {step.short_id} (depth {step.depth})")


@app.command()
def undo(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="Run whose last move to undo.")],
    as_json: Json = False,
) -> None:
    """Undo the last revert, reset, append or import of a run, using its reflog."""
    with _store(ctx) as store:
        step = store.undo(run)
        moved = _last_move(store, run)
    if as_json:
        print_json(moved.to_dict())
        return
    say(f"{run} moved back to {step.short_id if step else '(empty)'}")


@app.command()
def reflog(
    ctx: typer.Context,
    run: Annotated[str | None, typer.Argument(help="Run name.")] = None,
    every: Annotated[bool, typer.Option(
        "--all", help="Every run's moves, including runs whose ref is gone.")] = False,
    as_json: Json = False,
) -> None:
    """Every move of a run, newest first (nothing is ever lost)."""
    if (run is None) == (not every):
        raise UsageError("name a run, or pass --all (not both)")
    with _store(ctx) as store:
        entries = store.reflog(run)
    if as_json:
        print_json([e.to_dict() for e in entries])
        return
    for e in entries:
        old = e.old_head[:12] if e.old_head else "-"
        new = e.new_head[:12] if e.new_head else "-"
        which = f"{e.ref} " if every else ""
        say(f"{_when(e.created_at)} {which}{e.reason:7} {old:12} -> {new:12} {e.message}")


@app.command()
def note(
    ctx: typer.Context,
    spec: Annotated[str, typer.Argument(help="Step to annotate.")],
    text: Annotated[str, typer.Argument(help="The note.")],
    author: Annotated[str | None, typer.Option("--author", help="Who wrote it.")] = None,
    as_json: Json = False,
) -> None:
    """Attach a note to a step (the step itself never changes)."""
    with _store(ctx) as store:
        added = store.note(spec, text, author=author)
    if as_json:
        print_json(added.to_dict())
        return
    say(f"noted {added.step_id[:12]}")


@app.command()
def fsck(ctx: typer.Context, as_json: Json = False) -> None:
    """Re-hash every blob and step and check every reference. Exit 1 on problems."""
    with _store(ctx) as store:
        report = store.fsck()
    if as_json:
        print_json(report.to_dict())
    else:
        say(
            f"checked {report.num_blobs} blobs, {report.num_steps} steps, "
            f"{report.num_refs} runs, {report.num_notes} notes"
        )
        for problem in report.problems:
            say(f"problem: {problem}")
        say("ok" if report.is_ok else f"{len(report.problems)} problem(s)")
    if not report.is_ok:
        raise typer.Exit(1)


@app.command("export")
def export_run(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(
        help="Run to export (openai, atif and otel: any step address, e.g. RUN@N).")],
    output: Annotated[Path | None, typer.Option(
        "-o", "--output",
        help="File to write (an existing one only with --force); default: stdout.")] = None,
    fmt: Annotated[Format, typer.Option(
        "--format", "-f",
        help="bundle (kvtrace's own, lossless), openai (chat messages), atif (Harbor ATIF), "
        "otel (OpenTelemetry OTLP-JSON spans, GenAI conventions), claude-code (a Claude Code "
        "session transcript, JSONL) or codex (a Codex rollout, JSONL).")] = Format.BUNDLE,
    include_content: Annotated[bool, typer.Option(
        "--include-content",
        help="otel: also put prompts, responses, tool arguments and results in the spans "
        "(left out by default: they may hold secrets or personal data).")] = False,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Write a run to a file: a bundle, OpenAI messages, ATIF, OTel, or an agent's own log."""
    if include_content and fmt is not Format.OTEL:
        raise UsageError("--include-content applies to --format otel only")
    if output is None:
        if as_json:
            raise UsageError("--json reports on the file written: name it with -o FILE")
        with _store(ctx) as store, step_bar(f"export {run}") as on_step:
            export_file(store, run, sys.stdout.buffer, format=fmt,
                        include_content=include_content, on_step=on_step)
        sys.stdout.buffer.flush()
        return
    with output_file(output, force=force) as tmp:
        with tmp.open("wb") as file, _store(ctx) as store:
            with step_bar(f"export {run}") as on_step:
                export_file(store, run, file, format=fmt, include_content=include_content,
                            on_step=on_step)
            num_steps = next((s.depth for s in store.log(run, limit=1, lists=False)), 0)
            file.flush()
            os.fsync(file.fileno())
        num_bytes = tmp.stat().st_size
    if as_json:
        print_json({"run": run, "format": fmt.value, "path": str(output),
                    "num_steps": num_steps, "num_bytes": num_bytes})
        return
    say(f"exported {run} as {fmt.value} to {output}")


@app.command("import")
def import_run(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(
        help="File to import: a bundle, OpenAI chat messages, an ATIF trajectory, an "
        "OTLP-JSON trace, a Claude Code session transcript or a Codex rollout.")],
    fmt: Annotated[Format, typer.Option(
        "--format", "-f",
        help="bundle (written by `kvtrace export`), openai, atif, otel (OTLP-JSON spans "
        "with content), claude-code (a session's .jsonl; its subagents' files beside it "
        "become runs RUN/agent-ID) or codex (a rollout .jsonl).")] = Format.BUNDLE,
    run: Annotated[str | None, typer.Option(
        "--run", "--as",
        help="Run to create (default: a bundle's own run, else the file name to its first "
        "dot).")] = None,
    as_json: Json = False,
) -> None:
    """Import a file as a new run; a bad or modified file is refused whole, writing nothing."""
    if not file.exists():
        raise UsageError(f"no such file: {file}")
    if file.is_dir():
        raise UsageError(f"{file} is a folder: name one file to import")
    data = file.read_bytes()
    if not data.strip():
        raise UsageError(f"{file} is empty: there is nothing to import")
    with step_bar(f"import {file.name}") as on_step:
        infos = import_into(store_url(ctx), lambda store: _imported(store, import_file(
            store, io.BytesIO(data), format=fmt, run=run, filename=str(file), on_step=on_step),
            fmt))
    info, subagents = infos[0], infos[1:]
    if as_json:
        print_json({**info.to_dict(), **({"subagents": [s.to_dict() for s in subagents]}
                                          if fmt is Format.CLAUDE_CODE else {})})
        return
    say(f"imported {info.name} ({info.depth} steps)")
    for agent in subagents:
        say(f"imported {agent.name} ({agent.depth} steps), a subagent of {info.name}")


def _imported(store: Store, info: RunInfo, fmt: Format) -> list[RunInfo]:
    """The run an import made, then the runs of its subagents (Claude Code)."""
    return [info, *(subagent_runs(store, info.name) if fmt is Format.CLAUDE_CODE else [])]


def _fitted(line: str, width: int) -> str:
    """`line` cut to the terminal's `width` (at least 40; COLUMNS, else 80, off a terminal):
    its summary ends in "…", never past the edge."""
    width = max(width, 40)
    return line if len(line) <= width else line[: width - 1] + "…"
