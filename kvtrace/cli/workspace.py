"""Experiment outcomes: `kvtrace workspace` (restore a snapshot) and `kvtrace verify` (grade a
run after the fact). Each is one call of `kvtrace.workspace` or `kvtrace.workspace.verdicts`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtrace.cli.app import Json, app, print_json, say, store_url
from kvtrace.errors import UsageError
from kvtrace.store import open_store


@app.command("workspace")
def workspace_command(
    ctx: typer.Context,
    spec: Annotated[str, typer.Argument(help="RUN@K: a model call recorded with --workspace.")],
    output: Annotated[Path, typer.Option(
        "-o", "--output", help="Folder to write the files into (made if missing).")],
    force: Annotated[bool, typer.Option(
        "--force", help="Write into a folder that is not empty (files the snapshot names are "
        "overwritten, others left).")] = False,
    as_json: Json = False,
) -> None:
    """Write the files of the agent's folder as they were when step K's call was asked."""
    from kvtrace.store.kinds import workspace_of
    from kvtrace.workspace import restore
    from kvtrace.workspace.steps import snapshot_at

    with open_store(store_url(ctx), create=False) as store:
        step, tree = snapshot_at(store, spec)
        done = restore(store, tree, output, force=force)
    if as_json:
        print_json({"step": step.id, "workspace": workspace_of(step),
                    "folder": done.folder, "files": done.num_files, "links": done.num_links,
                    "bytes": done.num_bytes, "omitted": done.omitted})
        return
    files = f"{done.num_files} file{'' if done.num_files == 1 else 's'}"
    links = f"{done.num_links} link{'' if done.num_links == 1 else 's'}"
    say(f"wrote {files} ({done.num_bytes:,} bytes) and {links} into {done.folder}: the "
        f"folder as step {spec} ({step.short_id}) was asked")
    for path in done.omitted:
        say(f"  not written: {path} (over the size limit when recorded: kept by hash only)")


@app.command("verify")
def verify_command(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="The run to grade.")],
    cmd: Annotated[str, typer.Option("--cmd", help="The command, run through the shell.")],
    workdir: Annotated[Path, typer.Option(
        "--workdir", help="The folder to run it in (default: this one).")] = Path("."),
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds it may run (then it fails, code 124).")] = 600.0,
    as_json: Json = False,
) -> None:
    """Grade RUN after the fact: run CMD in the folder, append its verdict; exit 1 if failed."""
    from kvtrace.workspace.verdicts import check_command, record_verdict, run_verify

    check_command(cmd)
    if not workdir.is_dir():
        raise UsageError(f"--workdir {workdir}: not a folder")
    with open_store(store_url(ctx), create=False) as store:
        if not store.has_run(run):
            raise UsageError(f"no run {run!r}: `kvtrace runs` lists them")
        verdict = run_verify(cmd, workdir, timeout_s=timeout)
        step = record_verdict(store, run, verdict)
    if as_json:
        print_json({"run": run, "step": step.id, **verdict.to_dict()})
    else:
        what = "passed" if verdict.passed else f"failed (exit code {verdict.exit_code})"
        say(f"{run}: {what} in {verdict.seconds:.1f} s; verdict @{step.depth} {step.short_id}")
    raise typer.Exit(0 if verdict.passed else 1)
