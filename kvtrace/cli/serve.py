"""`kvtrace serve` and `kvtrace record -- COMMAND`: the recording server, in the foreground
or around one program. Each builds a server with `kvtrace.serve.make_server` and runs it.
With `--json`, the summary of what was recorded is one JSON object on stdout (after COMMAND's
own output, for `record`). In local mode each says once, at start, that any model name is
answered by the local model (unless --strict-model)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvtrace.cli.app import (
    Dtype,
    Json,
    Model,
    Precision,
    app,
    print_json,
    read_edit,
    say,
    store_url,
)
from kvtrace.errors import UsageError
from kvtrace.paths import default_cache_dir
from kvtrace.store import Store, open_store, validate_run_name

if TYPE_CHECKING:
    from kvtrace.engine.faults import DiskFaults
    from kvtrace.serve import ChatServer, RunStats
    from kvtrace.serve.experiment import ExperimentReport
    from kvtrace.workspace.verdicts import Verdict

Upstream = Annotated[str | None, typer.Option(
    "--upstream",
    help="Forward to this OpenAI-compatible server (its base URL, e.g. "
    "https://api.openai.com/v1) instead of answering with the local engine.")]
Run = Annotated[str | None, typer.Option(
    "--run",
    help="Record into this run (default: a new run per start; the X-Kvtrace-Run header "
    "wins).")]
UpstreamKey = Annotated[str | None, typer.Option(
    "--upstream-api-key", envvar="KVTRACE_UPSTREAM_API_KEY",
    help="Bearer token sent to the upstream instead of the client's "
    "($KVTRACE_UPSTREAM_API_KEY). Never recorded.")]
Redact = Annotated[list[str] | None, typer.Option(
    "--redact-header",
    help="Another header whose value must never be stored (repeatable); Authorization, "
    "api-key, x-api-key and cookies always are.")]
StrictModel = Annotated[bool, typer.Option(
    "--strict-model",
    help="Local mode: answer only requests naming the local model (others get a 404); by "
    "default any model name is answered by it, and the name asked for is recorded.")]
UpstreamTimeout = Annotated[float, typer.Option(
    "--upstream-timeout",
    help="Upstream mode: seconds the upstream may take to connect or to send the next bytes "
    "of its answer (past it, 504).")]
FromRun = Annotated[str | None, typer.Option(
    "--from",
    help="RUN@K: answer the agent from RUN's recorded model calls up to step K (each request "
    "that matches the next one), then live, recorded on a fork made where they parted (--run "
    "names it; default RUN-from-K).")]
EditFile = Annotated[str | None, typer.Option(
    "--edit",
    help="With --from: a JSON file of step K's fields to replace (e.g. {\"response\": "
    "{...}}): the agent is answered with the edited step.")]
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
MAX_QUEUE = 16
MAX_BODY_BYTES = 16 * 1024 * 1024
UPSTREAM_TIMEOUT_S = 600.0
API_KEY_ENV = "KVTRACE_SERVE_API_KEY"


def _chat_server(store: Store, *, upstream: str | None, model: str | None, run: str | None,
                 run_prefix: str, api_key: str | None, upstream_api_key: str | None,
                 redact_headers: list[str], max_queue: int, max_body_bytes: int,
                 upstream_timeout: float, strict_model: bool, from_run: str | None = None,
                 edit: str | None = None, command: str = "serve", num_agents: int | None = None,
                 seed: int | None = None, workdir: str | None = None,
                 dtype: Precision = Precision.AUTO) -> ChatServer:
    """Check the options (before any model loads), then build the server; with `from_run`,
    warm the local engine's KV with the recorded prefix first (fromrun.py); with
    `num_agents`, for that many copies of the agent (agents.py)."""
    from kvtrace.serve import make_server
    from kvtrace.serve.app import check_api_key
    from kvtrace.serve.recording import new_run_name

    if upstream is not None and model is not None:
        raise UsageError("--model is for local mode: with --upstream the upstream's model answers")
    if upstream is not None and dtype is Precision.BFLOAT16:
        raise UsageError("--dtype is for local mode: with --upstream the upstream computes")
    if upstream is not None and strict_model:
        raise UsageError("--strict-model is for local mode: with --upstream the upstream "
                         "decides which model names it answers")
    if upstream is not None and not upstream.startswith(("http://", "https://")):
        raise UsageError(f"--upstream {upstream!r} must start with http:// or https://")
    if max_queue < 0 or max_body_bytes < 1:
        raise UsageError("--max-queue must be >= 0 and --max-body-bytes >= 1")
    if not upstream_timeout > 0:
        raise UsageError(f"--upstream-timeout must be > 0 seconds, not {upstream_timeout}")
    check_api_key(api_key, "--api-key")
    check_api_key(upstream_api_key, "--upstream-api-key")
    changes = read_edit(edit) if edit is not None else None
    if changes is not None and from_run is None:
        raise UsageError("--edit changes step K of --from RUN@K: give --from too")
    if num_agents is not None and from_run is None:
        raise UsageError("--n runs K copies of an agent forked at one step: give --from RUN@K")
    if seed is not None and num_agents is None:
        raise UsageError("--seed gives the K agents of --n their seeds: give --n too")
    agents = []
    if num_agents is not None and from_run is not None:
        from kvtrace.serve.agents import make_agents

        base = run or from_run.replace("@", "-from-").replace("~", "-back-")
        agents = make_agents(store, base, num_agents, seed=seed or 0, workdir=workdir)
        run = None
        max_queue = max(max_queue, 2 * num_agents)  # an agent's request is never a 429
    elif from_run is not None and run is None:
        from kvtrace.tracer.prefix import free_fork_name

        run = free_fork_name(store, from_run.replace("@", "-from-").replace("~", "-back-"))
    run = validate_run_name(run) if run is not None else new_run_name(store, run_prefix)
    if from_run is not None:
        store.path(from_run)  # an unknown RUN@K fails here, before any model loads
    backend = None
    if upstream is None:
        from kvtrace.replay import open_local_backend

        # Loaded on the engine thread that will decode (DecodeBatcher.loading).
        backend = open_local_backend(model, cache_dir=default_cache_dir(), batching=True,
                                     dtype=dtype.value)
        layout = backend.engine.layout
        if not layout.is_plain:  # which cache each layer keeps, and where hits can resume
            say(f"kvtrace {command}: {backend.engine.name}: {layout.describe()}; cache hits "
                f"resume at block boundaries", err=True)
    server = make_server(backend=backend, upstream=upstream, store=store, run=run,
                         api_key=api_key, upstream_api_key=upstream_api_key,
                         redact_headers=redact_headers, max_queue=max_queue,
                         max_body_bytes=max_body_bytes, upstream_timeout=upstream_timeout,
                         strict_model=strict_model, from_run=from_run, edit=changes,
                         agents=agents)
    if from_run is not None and backend is not None:
        from kvtrace.serve.fromrun import warm

        tokens = warm(store, from_run, backend)
        say(f"kvtrace {command}: the KV of {from_run}'s {tokens:,} prompt tokens is warm",
            err=True)
    return server


def _say_model_rule(server: ChatServer, command: str) -> None:
    """Local mode: the one line that says which model answers which names."""
    model = server.answerer.model
    if model is None:
        return
    if server.answerer.required_model is not None:
        say(f"kvtrace {command}: only requests naming '{model}' are answered (--strict-model)",
            err=True)
    else:
        say(f"kvtrace {command}: every model name is answered by the local model '{model}' "
            "(the name asked for is recorded as request_model; --strict-model refuses others)",
            err=True)


@app.command("serve")
def serve_command(
    ctx: typer.Context,
    upstream: Upstream = None,
    model: Model = None,
    dtype: Dtype = Precision.AUTO,
    host: Annotated[str, typer.Option(
        "--host", help="Address to listen on (loopback only by default; 0.0.0.0 exposes the "
        "server to the network).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", help="Port to listen on (0: any free port).")] = 8000,
    run: Run = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=API_KEY_ENV,
        help="Require 'Authorization: Bearer KEY' from clients ($KVTRACE_SERVE_API_KEY); "
        "needed with a --host other than loopback.")] = None,
    upstream_api_key: UpstreamKey = None,
    redact_header: Redact = None,
    max_queue: Annotated[int, typer.Option(
        "--max-queue",
        help="Local mode: the server holds at most N + 1 requests (decoded together, up to "
        "16, or waiting for a place); past it, 429.")] = MAX_QUEUE,
    max_body_bytes: Annotated[int, typer.Option(
        "--max-body-bytes", help="Largest request body accepted (else 413).")] = MAX_BODY_BYTES,
    upstream_timeout: UpstreamTimeout = UPSTREAM_TIMEOUT_S,
    strict_model: StrictModel = False,
    from_run: FromRun = None,
    edit: EditFile = None,
    as_json: Json = False,
) -> None:
    """A server for the OpenAI chat, Anthropic Messages and OpenAI Responses APIs that records
    every call into a run (see docs/serve.md)."""
    from kvtrace.serve import BackgroundServer

    check_listening(host, port, api_key, env=API_KEY_ENV, what="server")
    with open_store(store_url(ctx)) as store:
        server = _chat_server(store, upstream=upstream, model=model, run=run, run_prefix="serve",
                              api_key=api_key, upstream_api_key=upstream_api_key,
                              redact_headers=redact_header or [], max_queue=max_queue,
                              max_body_bytes=max_body_bytes, upstream_timeout=upstream_timeout,
                              strict_model=strict_model, from_run=from_run, edit=edit,
                              dtype=dtype)
        running = BackgroundServer(server.app, host=host, port=port).start()
        say(f"kvtrace serve: {running.url} ({server.answerer.description}), recording into run "
            f"'{server.default_run}' of {store.display_url}; Ctrl-C stops", err=True)
        _say_model_rule(server, "serve")
        running.wait()
    faults = _cache_faults(server)
    if as_json:
        print_json({**_summary(server.stats), **_from_summary(server),
                    "cache_faults": _faults_json(faults),
                    "unrecorded": server.recording.unrecorded[0]})
        return
    _print_summary(server.stats)
    _print_from(server, "serve")
    _say_cache_faults(faults, "serve")
    _say_unrecorded(server, "serve")


def _cache_faults(server: ChatServer) -> DiskFaults | None:
    """What the local engine's disk tier could not write, or evicted past its budget, while
    serving (None: neither, or there is no local engine)."""
    faults = server.answerer.take_cache_faults()
    return faults if faults and (faults.num_failed_writes or faults.num_evicted_blocks) else None


def _say_unrecorded(server: ChatServer, command: str) -> None:
    """The closing line for the answers a full store disk did not take."""
    count, reason = server.recording.unrecorded
    if count:
        say(f"kvtrace {command}: {count} answer{'' if count == 1 else 's'} not recorded: "
            f"{reason}", err=True)


def _faults_json(faults: DiskFaults | None) -> dict[str, object] | None:
    if faults is None:
        return None
    return {"failed_writes": faults.num_failed_writes, "reasons": list(faults.write_reasons),
            "folder": faults.folder, "uncounted": faults.num_uncounted,
            "evicted_blocks": faults.num_evicted_blocks,
            "evicted_bytes": faults.num_evicted_bytes, "disk_budget": faults.disk_budget}


def _say_cache_faults(faults: DiskFaults | None, command: str) -> None:
    """The closing lines for `_cache_faults`: blocks not written, blocks evicted."""
    from kvtrace.engine.faults import disk_faults_lines

    for line in disk_faults_lines(faults):
        say(f"kvtrace {command}: {line}", err=True)


def check_listening(host: str, port: int, api_key: str | None, *, env: str, what: str) -> None:
    """Where a server of kvtrace (`serve`, `ui`) may listen: a port number, and a key
    (`--api-key` or `$env`, set and not empty) whenever `host` is not loopback."""
    from kvtrace.serve.runner import is_loopback

    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is not a port number (0-65535)")
    if api_key is None and os.environ.get(env) == "":
        raise UsageError(f"${env} is set but empty: set it to the key clients must "
                         "send, or unset it to serve without one")
    if api_key is None and not is_loopback(host):
        raise UsageError(f"--host {host} lets other machines reach the {what}: give --api-key "
                         f"KEY (or ${env}) too, or keep the default 127.0.0.1")


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
    workspace: Workspace = None,
    verify: Verify = None,
    verify_timeout: VerifyTimeout = 600.0,
    as_json: Json = False,
) -> None:
    """Run COMMAND against a recording server on a free loopback port (OPENAI_BASE_URL,
    ANTHROPIC_BASE_URL); with --from RUN@K --n K, K copies of it at once.

    SIGTERM and SIGINT go on to COMMAND, which is waited for."""
    from kvtrace.serve import BackgroundServer
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
        server = _chat_server(store, upstream=upstream, model=model, run=run, run_prefix="record",
                              api_key=None, upstream_api_key=upstream_api_key,
                              redact_headers=redact_header or [], max_queue=MAX_QUEUE,
                              max_body_bytes=MAX_BODY_BYTES, upstream_timeout=upstream_timeout,
                              strict_model=strict_model, from_run=from_run, edit=edit,
                              command="record", num_agents=num_agents, seed=seed,
                              workdir=workdir, dtype=dtype)
        if server.agents and from_run is not None:
            outcome.watch(server, [(agent.fork, agent.workdir) for agent in server.agents])
            _record_agents(store, server, from_run, command, outcome, as_json=as_json)
            return
        cwd = Path(workdir).resolve() if workdir is not None else None
        outcome.watch(server, [(server.default_run, cwd)])
        with BackgroundServer(server.app) as running:
            say(f"kvtrace record: run '{server.default_run}', {running.url}", err=True)
            _say_model_rule(server, "record")
            code = run_command(command, client_env(os.environ, running.url), cwd=cwd)
        verdict = outcome.grade(store, server.default_run, cwd)
    faults = _cache_faults(server)
    if as_json:
        sys.stdout.flush()
        print_json({"run": server.default_run, "exit_code": code, **_summary(server.stats),
                    **_from_summary(server), "cache_faults": _faults_json(faults),
                    "unrecorded": server.recording.unrecorded[0],
                    **({"verdict": verdict.to_dict()} if verdict is not None else {})})
    else:
        _print_summary(server.stats, default=server.default_run)
        _print_from(server, "record")
        _say_cache_faults(faults, "record")
        _say_unrecorded(server, "record")
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

    def grade(self, store: Store, run: str, folder: Path | None) -> Verdict | None:
        """Run the verify command in the agent's folder; its verdict, appended to `run`."""
        from kvtrace.workspace.verdicts import record_verdict, run_verify

        if self.verify is None:
            return None
        verdict = run_verify(self.verify, folder or Path.cwd(), timeout_s=self.verify_timeout)
        record_verdict(store, run, verdict)
        return verdict


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

    with BackgroundServer(server.app) as running:
        say(f"kvtrace record: {len(server.agents)} agents from {spec}, agent i at "
            f"{running.url.removesuffix('/v1')}/a/i/v1, on forks "
            f"{server.agents[0].fork} ... {server.agents[-1].fork}", err=True)
        _say_model_rule(server, "record")
        exits = run_agents(command, server.agents, running.url)
    verdicts = {agent.index: outcome.grade(store, agent.fork, agent.workdir)
                for agent in server.agents}
    report = ExperimentReport.of(store, spec, server, exits, verdicts)
    faults = _cache_faults(server)
    if as_json:
        sys.stdout.flush()
        print_json({**report.to_dict(), "batch": server.answerer.health().get("batch"),
                    "cache_faults": _faults_json(faults),
                    "unrecorded": server.recording.unrecorded[0]})
    else:
        render_experiment(report)
        _say_cache_faults(faults, "record")
        _say_unrecorded(server, "record")
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
    if verified:
        graded = report.num_passed + report.num_failed
        say(f"kvtrace record: {report.num_passed} of {graded} passed "
            f"({report.runs[0].verdict.command if report.runs[0].verdict else 'verify'})",
            err=True)
    sys.stderr.flush()


def _from_summary(server: ChatServer) -> dict[str, object]:
    """--json's `from` object (with --from): what the recorded part did."""
    summary = getattr(server.answerer, "summary", None)
    if summary is None:
        return {}
    stats = server.stats.get(summary.fork)
    return {"from": {**summary.to_dict(),
                     "reused_tokens": stats.cached_tokens if stats is not None else 0}}


def _print_from(server: ChatServer, command: str) -> None:
    """The closing line of a --from run: "6 of 6 recorded calls answered ..."."""
    summary = getattr(server.answerer, "summary", None)
    if summary is not None:
        stats = server.stats.get(summary.fork)
        say(f"kvtrace {command}: " + summary.line(stats.cached_tokens if stats else None),
            err=True)


def _summary(stats: dict[str, RunStats]) -> dict[str, object]:
    """What --json prints: per run written to, its calls and token counts."""
    return {"runs": {name: dataclasses.asdict(run) for name, run in stats.items()}}


def _print_summary(stats: dict[str, RunStats], default: str | None = None) -> None:
    """One line per run written to: calls, tokens, cached tokens (or unknown)."""
    if not stats and default is not None:
        say(f"kvtrace record: run '{default}': no model calls recorded", err=True)
    for name, run in stats.items():
        if run.unknown_cached == run.calls:
            cached = "cached unknown"
        else:
            cached = f"{run.cached_tokens:,} cached"
            if run.unknown_cached:
                cached += f" ({run.unknown_cached} calls unknown)"
        others = f", {run.other_steps} other requests" if run.other_steps else ""
        say(f"recorded run '{name}': {run.calls} model call"
                   f"{'' if run.calls == 1 else 's'}, {run.prompt_tokens:,} prompt tokens "
                   f"({cached}), {run.completion_tokens:,} completion tokens{others}",
                   err=True)
    sys.stderr.flush()
