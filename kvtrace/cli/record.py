"""`kvtrace record -- COMMAND`: run an agent against a recording server; with `--from RUN@K
--n K`, K copies of it at once, compared; `--workspace` and `--verify` keep what each left.

The server is serve.py's (`chat_server`); this module adds running the
command, the agents' table and their outcomes (kvtrace/workspace).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvtrace.cli.app import Dtype, Json, Model, Precision, app, print_json, say, store_url
from kvtrace.cli.serve import (
    MAX_BODY_BYTES,
    MAX_QUEUE,
    UPSTREAM_TIMEOUT_S,
    EditFile,
    FromRun,
    Redact,
    Run,
    StrictModel,
    Upstream,
    UpstreamKey,
    UpstreamTimeout,
    cache_faults,
    chat_server,
    faults_json,
    from_summary,
    print_from,
    print_summary,
    say_cache_faults,
    say_model_rule,
    say_unrecorded,
    summary_json,
)
from kvtrace.errors import UsageError
from kvtrace.store import Store, open_store

if TYPE_CHECKING:
    from kvtrace.serve import ChatServer
    from kvtrace.serve.experiment import ExperimentReport
    from kvtrace.workspace.tree import Tree
    from kvtrace.workspace.verdicts import Verdict

NumAgents = Annotated[int | None, typer.Option(
    "--n",
    help="With --from: run COMMAND K times at once from the fork point, against one server "
    "(one engine; requests in flight decoded together); agent i at /a/i/v1, recorded on its "
    "own fork (NAME-i), sampled with its own seed; then compare the K runs.")]
AgentSeed = Annotated[int | None, typer.Option(
    "--seed",
    help="With --n: agent i's sampled requests that send no seed use S + i - 1 (default 0).")]
Workdir = Annotated[str | None, typer.Option(
    "--workdir",
    help="COMMAND's working folder, made if missing; with --n, {i} in it is the agent's "
    "number (e.g. 'runs/agent-{i}').")]
Models = Annotated[str | None, typer.Option(
    "--models",
    help="With --n: A,B,...: agent i answered by model (i - 1) mod their number; locally each "
    "a model folder or .gguf (an engine, cache and batcher each), upstream a model name.")]
Workspace = Annotated[str | None, typer.Option(
    "--workspace",
    help="Snapshot DIR (inside COMMAND's folder; e.g. '.') before each model call: files kept "
    "once in the store, named by the call (`kvtrace workspace RUN@K`, `diff --files`).")]
Verify = Annotated[str | None, typer.Option(
    "--verify",
    help="After COMMAND exits, run CMD through the shell in its folder (each agent's, with "
    "--n) and append its verdict to the run; exit 1 when one failed.")]
VerifyTimeout = Annotated[float, typer.Option(
    "--verify-timeout", help="Seconds --verify's command may run (then it fails, code 124).")]


@app.command("record", context_settings={"allow_interspersed_args": False})
def record_command(
    ctx: typer.Context,
    command: Annotated[list[str], typer.Argument(help="The program to run, after '--'.")],
    upstream: Upstream = None,
    model: Model = None,
    dtype: Dtype = Precision.AUTO,
    run: Run = None,
    upstream_api_key: UpstreamKey = None,
    redact_header: Redact = None,
    upstream_timeout: UpstreamTimeout = UPSTREAM_TIMEOUT_S,
    strict_model: StrictModel = False,
    from_run: FromRun = None,
    edit: EditFile = None,
    num_agents: NumAgents = None,
    seed: AgentSeed = None,
    workdir: Workdir = None,
    models: Models = None,
    workspace: Workspace = None,
    verify: Verify = None,
    verify_timeout: VerifyTimeout = 600.0,
    as_json: Json = False,
) -> None:
    """Run COMMAND against a recording server on a free loopback port (OPENAI_BASE_URL,
    ANTHROPIC_BASE_URL); with --from RUN@K --n K, K copies of it at once.

    SIGTERM and SIGINT go on to COMMAND, which is waited for."""
    from kvtrace.serve import BackgroundServer
    from kvtrace.serve.loading import raise_failed_load
    from kvtrace.serve.runner import check_program, client_env, run_command
    from kvtrace.workspace.snapshot import workspace_folder
    from kvtrace.workspace.verdicts import check_command

    if workdir is not None and num_agents is None and "{i}" in workdir:
        raise UsageError(f"--workdir {workdir!r}: {{i}} is the agent's number with --n")
    check_program(command, workdir)
    check_command(verify)
    if not verify_timeout > 0:
        raise UsageError(f"--verify-timeout {verify_timeout:g}: give seconds > 0")
    if workspace is not None:  # checked for agent 1's folder before anything loads
        workspace_folder(Path(workdir.replace("{i}", "1")) if workdir else Path.cwd(), workspace)
    outcome = _Outcome(workspace, verify, verify_timeout)
    with open_store(store_url(ctx)) as store:
        start = _start_tree(store, from_run, workdir, num_agents)
        if start is not None:  # the fork is snapshotted too
            outcome = dataclasses.replace(outcome, workspace=workspace or ".")
        server = chat_server(store, upstream=upstream, model=model, run=run, run_prefix="record",
                             api_key=None, upstream_api_key=upstream_api_key,
                             redact_headers=redact_header or [], max_queue=MAX_QUEUE,
                             max_body_bytes=MAX_BODY_BYTES, upstream_timeout=upstream_timeout,
                             strict_model=strict_model, from_run=from_run, edit=edit,
                             command="record", num_agents=num_agents, seed=seed,
                             workdir=workdir, dtype=dtype,
                             models=models.split(",") if models is not None else None)
        if start is not None:
            outcome.fill(store, start, [agent.workdir for agent in server.agents]
                         or [Path(workdir or ".").resolve()])
        if server.agents and from_run is not None:
            outcome.watch(server, [(agent.fork, agent.workdir) for agent in server.agents])
            _record_agents(store, server, from_run, command, outcome, as_json=as_json)
            return
        cwd = Path(workdir).resolve() if workdir is not None else None
        outcome.watch(server, [(server.default_run, cwd)])
        with BackgroundServer(server.app) as running:
            say(f"kvtrace record: run '{server.default_run}', {running.url}", err=True)
            say_model_rule(server, "record")
            code = run_command(command, client_env(os.environ, running.url), cwd=cwd)
        raise_failed_load(server.answerer)  # its error, exit 2 (one nothing needed: no wait)
        verdict = outcome.grade(store, server.default_run, cwd)
    faults = cache_faults(server)
    if as_json:
        sys.stdout.flush()
        print_json({"run": server.default_run, "exit_code": code, **summary_json(server.stats),
                    **from_summary(server), "cache_faults": faults_json(faults),
                    "unrecorded": server.recording.unrecorded[0],
                    **({"verdict": verdict.to_dict()} if verdict is not None else {})})
    else:
        print_summary(server.stats, default=server.default_run)
        print_from(server, "record")
        say_cache_faults(faults, "record")
        say_unrecorded(server, "record")
        if verdict is not None:
            _say_verdict(verdict, server.default_run)
    raise typer.Exit(code or (1 if verdict is not None and not verdict.passed else 0))


@dataclasses.dataclass(frozen=True, slots=True)
class _Outcome:
    """What `record` keeps of each agent's folder (`--workspace`) and grades (`--verify`)."""

    workspace: str | None
    verify: str | None
    verify_timeout: float

    def watch(self, server: ChatServer, runs: list[tuple[str, Path | None]]) -> None:
        """Snapshot each run's workspace before each of its model calls."""
        from kvtrace.workspace.snapshot import workspace_folder

        if self.workspace is None:
            return
        for run, folder in runs:
            server.recording.snapshot_workspace(
                run, workspace_folder(folder or Path.cwd(), self.workspace))

    def fill(self, store: Store, tree: Tree, folders: Sequence[Path | None]) -> None:
        """Write `tree` into each agent's workspace before it starts (`_start_tree`)."""
        from kvtrace.workspace import restore
        from kvtrace.workspace.snapshot import workspace_folder

        for folder in folders:
            restore(store, tree, workspace_folder(folder or Path.cwd(), self.workspace or "."))

    def grade(self, store: Store, run: str, folder: Path | None) -> Verdict | None:
        """Run the verify command in the agent's folder; its verdict, appended to `run`."""
        from kvtrace.workspace.verdicts import record_verdict, run_verify

        if self.verify is None:
            return None
        verdict = run_verify(self.verify, folder or Path.cwd(), timeout_s=self.verify_timeout)
        record_verdict(store, run, verdict)
        return verdict


def _start_tree(store: Store, from_run: str | None, workdir: str | None,
                num_agents: int | None) -> Tree | None:
    """Where a fork's agents start, with `--from RUN@K --workdir`: RUN's folder as its first
    recorded call saw it (None: no --workdir, or RUN has no snapshot). Each agent's folder
    must be missing or empty, checked here, before anything loads."""
    from kvtrace.workspace.steps import first_snapshot

    if from_run is None or workdir is None:
        return None
    tree = first_snapshot(store, from_run)
    if tree is None:
        return None
    count = num_agents or 1
    for index in range(1, count + 1):
        folder = Path(workdir.replace("{i}", str(index)))
        if folder.is_dir() and any(folder.iterdir()):
            raise UsageError(f"--workdir {folder} is not empty: the fork starts from "
                             f"{from_run.split('@')[0]}'s recorded workspace, written into "
                             "it; give a new or empty folder")
    return tree


def _say_verdict(verdict: Verdict, run: str) -> None:
    what = "passed" if verdict.passed else f"failed (exit code {verdict.exit_code})"
    say(f"kvtrace record: verify {what} in {verdict.seconds:.1f} s: {verdict.command} "
        f"(the verdict is the last step of '{run}')", err=True)


def _record_agents(store: Store, server: ChatServer, spec: str, command: list[str],
                   outcome: _Outcome, *, as_json: bool) -> None:
    """`record --from RUN@K --n K`: the K agents at once, then their comparison; exits with
    the first agent's exit code that is not 0."""
    from kvtrace.serve import BackgroundServer
    from kvtrace.serve.experiment import ExperimentReport, run_agents
    from kvtrace.serve.loading import raise_failed_load

    with BackgroundServer(server.app) as running:
        say(f"kvtrace record: {len(server.agents)} agents from {spec}, agent i at "
            f"{running.url.removesuffix('/v1')}/a/i/v1, on forks "
            f"{server.agents[0].fork} ... {server.agents[-1].fork}", err=True)
        say_model_rule(server, "record")
        exits = run_agents(command, server.agents, running.url)
    raise_failed_load(server.answerer)
    verdicts = {agent.index: outcome.grade(store, agent.fork, agent.workdir)
                for agent in server.agents}
    report = ExperimentReport.of(store, spec, server, exits, verdicts)
    faults = cache_faults(server)
    if as_json:
        sys.stdout.flush()
        print_json({**report.to_dict(), "batch": server.answerer.health().get("batch"),
                    "cache_faults": faults_json(faults),
                    "unrecorded": server.recording.unrecorded[0]})
    else:
        render_experiment(report)
        say_cache_faults(faults, "record")
        say_unrecorded(server, "record")
    raise typer.Exit(report.exit_code)


def render_experiment(report: ExperimentReport) -> None:
    """The K runs side by side, as `kvtrace branch` shows its branches, then the time."""
    # The run names as wide as the longest, the final output in what the terminal has left
    # (at least 12 characters): a row reads at 80 columns, and uses a wider terminal whole.
    name = max([len(run.agent.fork) for run in report.runs] + [3])
    verified = report.is_verified  # a verdict column: pass, FAIL, or - (not graded)
    head = (f"{'run':<{name}} {'seed':>4} {'exit':>4} {'recorded':>8} {'live':>4} "
            f"{'prompt':>7} {'cached':>7} {'output':>6} {'diverges':>8}  "
            + ("test  " if verified else ""))
    room = max(12, shutil.get_terminal_size().columns - len(head) - 1)
    say(head + "final output", err=True)
    for run in report.runs:
        row = run.to_dict()
        served = f"{run.summary.num_served}/{run.summary.num_recorded}"
        where = "-" if run.diverged_at is None else f"@{run.diverged_at}"
        text = " ".join(run.output.split())
        text = text if len(text) <= room else text[: room - 1] + "…"
        verdict = ("-" if run.verdict is None else "pass" if run.verdict.passed else "FAIL")
        say(f"{row['run']:<{name}} {row['seed']:>4} {row['exit_code']:>4} {served:>8} "
            f"{row['live_calls']:>4} {row['prompt_tokens']:>7} {row['cached_tokens']:>7} "
            f"{row['completion_tokens']:>6} {where:>8}  "
            + (f"{verdict:<4}  " if verified else "") + text, err=True)
    for run in report.runs:
        if run.summary.parted:
            say(f"{run.agent.fork}: parted early: {run.summary.parted}", err=True)
    num, prefix = len(report.runs), report.prefix_recorded_s
    calls = report.runs[0].summary.num_recorded if report.runs else 0
    say(f"kvtrace record: {num} agents took {report.wall_s:.1f} s together; a full re-run of "
        f"each would also compute {report.spec}'s {calls} model calls again: +{prefix:.1f} s "
        f"each by their recorded durations ({num * prefix:.1f} s for the {num})", err=True)
    groups = report.by_model()
    for group in groups if len(groups) > 1 else []:
        agents = ", ".join(str(i) for i in group["agents"])
        passed = (f"{group['passed']} of {group['graded']} passed, " if group["graded"]
                  else "")
        say(f"kvtrace record: {group['model']} (agents {agents}): {passed}"
            f"{group['prompt_tokens']:,} prompt tokens ({group['cached_tokens']:,} cached), "
            f"{group['completion_tokens']:,} out, {group['seconds']:.1f} s", err=True)
    if verified:
        graded = report.num_passed + report.num_failed
        say(f"kvtrace record: {report.num_passed} of {graded} passed "
            f"({report.runs[0].verdict.command if report.runs[0].verdict else 'verify'})",
            err=True)
    sys.stderr.flush()
