"""`kvtrace serve`: the recording server in the foreground, and what `kvtrace record -- COMMAND`
(record.py, the same server around one program) shares with it: the options, `chat_server`
(checks, then `kvtrace.serve.make_server`) and the closing lines. With `--json`, the summary
of what was recorded is one JSON object on stdout. In local mode each says once, at start,
that any model name is answered by the local model (unless --strict-model)."""

from __future__ import annotations

import dataclasses
import functools
import os
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
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve import ChatServer, RunStats

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
MAX_QUEUE = 16
MAX_BODY_BYTES = 16 * 1024 * 1024
UPSTREAM_TIMEOUT_S = 600.0
API_KEY_ENV = "KVTRACE_SERVE_API_KEY"


def chat_server(store: Store, *, upstream: str | None, model: str | None, run: str | None,
                run_prefix: str, api_key: str | None, upstream_api_key: str | None,
                redact_headers: list[str], max_queue: int, max_body_bytes: int,
                upstream_timeout: float, strict_model: bool, from_run: str | None = None,
                edit: str | None = None, command: str = "serve", num_agents: int | None = None,
                seed: int | None = None, workdir: str | None = None,
                dtype: Precision = Precision.AUTO, models: list[str] | None = None
                ) -> ChatServer:
    """Check the options (before any model loads), then build the server, whose local
    models load in the background (`_load_backend`; with `from_run`, each warmed with the
    recorded prefix before its first live answer); with `num_agents`, for that many copies
    of the agent (agents.py), answered by `models` in turn when given (models.py). The
    caller waits for the load with `wait_loaded` (serve), or asks for its error with
    `raise_failed_load` once the command ended (record; serve/loading.py)."""
    from kvtrace.serve import BackendLoad, make_server
    from kvtrace.serve.app import check_api_key
    from kvtrace.serve.recording import new_run_name

    if upstream is not None and model is not None:
        raise UsageError("--model is for local mode: with --upstream the upstream's model answers")
    if models is not None:
        _check_models(models, model=model, num_agents=num_agents, is_local=upstream is None)
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
    loads: list[BackendLoad] = []
    if upstream is None:
        from kvtrace.engine.folders import model_name

        names: list[str | None] = list(models) if models else [model]
        root = default_cache_dir()
        loads = [BackendLoad(model_name(name, root), functools.partial(
            _load_backend, store, name, dtype=dtype, from_run=from_run, command=command,
            named=len(names) > 1)) for name in names]
    named = [load.model for load in loads]
    if len(set(named)) < len(named):
        raise UsageError(f"--models: two models are named alike ({', '.join(named)}): the "
                         "report tells them apart by name; give folders named differently")
    # The models load on threads of their own while the server answers (serve/loading.py).
    return make_server(backend=loads or None, upstream=upstream,
                       upstream_models=models if upstream is not None and models else (),
                       store=store, run=run,
                       api_key=api_key, upstream_api_key=upstream_api_key,
                       redact_headers=redact_headers, max_queue=max_queue,
                       max_body_bytes=max_body_bytes, upstream_timeout=upstream_timeout,
                       strict_model=strict_model, from_run=from_run, edit=changes,
                       agents=agents)


def _load_backend(store: Store, name: str | None, *, dtype: Precision, from_run: str | None,
                  command: str, named: bool) -> LocalBackend:
    """One local model, loaded on the engine thread that will decode (DecodeBatcher.loading);
    with `from_run`, its KV warmed with the recorded prefix (fromrun.py) before any live
    call is answered. `named`: the lines name the model (several answer)."""
    from kvtrace.replay import open_local_backend
    from kvtrace.serve.fromrun import warm

    try:
        backend = open_local_backend(name, cache_dir=default_cache_dir(), batching=True,
                                     dtype=dtype.value)
    except Exception as exc:
        if command == "record":  # said now: the agent's calls get a 503 until it ends
            say(f"kvtrace record: the model did not load, so its calls are answered 503: "
                f"{' '.join(str(exc).split())}", err=True)
        raise
    try:
        layout = backend.engine.layout
        if not layout.is_plain:  # which cache each layer keeps, and where hits resume
            say(f"kvtrace {command}: {backend.engine.name}: {layout.describe()}; cache hits "
                "resume at block boundaries", err=True)
        if from_run is not None:
            tokens = warm(store, from_run, backend)
            say(f"kvtrace {command}: the KV of {from_run}'s {tokens:,} prompt tokens is warm"
                + (f" in {backend.engine.name}" if named else ""), err=True)
    except BaseException:
        backend.close()
        raise
    return backend


def _check_models(models: list[str], *, model: str | None, num_agents: int | None,
                  is_local: bool) -> None:
    """`--models A,B,...`: with --n, not with --model, and locally each a folder or file."""
    if num_agents is None:
        raise UsageError("--models answers the K agents of --n in turn: give --from RUN@K "
                         "--n K too")
    if model is not None:
        raise UsageError("give --model or --models, not both")
    if len(models) < 2 or not all(models) or len(set(models)) < len(models):
        raise UsageError(f"--models {','.join(models)!r}: name two or more different ones, "
                         "separated by commas")
    if is_local:
        for name in models:
            if not Path(name).exists():
                raise UsageError(f"--models: {name} is no model folder or GGUF file here "
                                 "(locally each model is a folder or a .gguf file)")


def say_model_rule(server: ChatServer, command: str) -> None:
    """The one line that says which model answers which names (local mode), or which agents
    (several models)."""
    from kvtrace.serve.models import ByAgent

    inner = getattr(server.answerer, "inner", server.answerer)  # behind FromRecording
    if isinstance(inner, ByAgent):
        agents: dict[str | None, list[str]] = {}
        for agent in server.agents:
            agents.setdefault(inner.model_of(agent.index), []).append(str(agent.index))
        said = "; ".join(f"{name}: agents {', '.join(numbers)}"
                         for name, numbers in agents.items())
        say(f"kvtrace {command}: agent i is answered by model (i - 1) mod "
            f"{len(inner.models)}: {said}", err=True)
        return
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
    from kvtrace.serve.loading import abandon_loads, wait_loaded
    from kvtrace.serve.runner import stop_signals

    check_listening(host, port, api_key, env=API_KEY_ENV, what="server")
    with open_store(store_url(ctx)) as store:
        server = chat_server(store, upstream=upstream, model=model, run=run, run_prefix="serve",
                             api_key=api_key, upstream_api_key=upstream_api_key,
                             redact_headers=redact_header or [], max_queue=max_queue,
                             max_body_bytes=max_body_bytes, upstream_timeout=upstream_timeout,
                             strict_model=strict_model, from_run=from_run, edit=edit,
                             dtype=dtype)
        running = BackgroundServer(server.app, host=host, port=port).start()
        # A signal stops the server from here on, the load included (a background job's
        # SIGINT is ignored until handled: runner.py's `stop_signals`).
        with stop_signals() as stopping:
            say(f"kvtrace serve: {running.url} ({server.answerer.description}), recording into "
                f"run '{server.default_run}' of {store.display_url}; Ctrl-C stops", err=True)
            say_model_rule(server, "serve")
            try:
                # the models load meanwhile (serve/loading.py)
                is_loaded = wait_loaded(server.answerer, until=stopping)
            except BaseException:  # it failed: stop now
                abandon_loads(server.answerer)
                running.stop()
                raise
            if not is_loaded:  # stopped during the load: whatever still loads is left
                abandon_loads(server.answerer)
            elif server.answerer.model is not None:
                say(f"kvtrace serve: loaded: {server.answerer.description}", err=True)
            running.wait_for_signal(stopping)
        running.stop()
    faults = cache_faults(server)
    if as_json:
        print_json({**summary_json(server.stats), **from_summary(server),
                    "cache_faults": faults_json(faults),
                    "unrecorded": server.recording.unrecorded[0]})
        return
    print_summary(server.stats)
    print_from(server, "serve")
    say_cache_faults(faults, "serve")
    say_unrecorded(server, "serve")


def cache_faults(server: ChatServer) -> DiskFaults | None:
    """What the local engine's disk tier could not write, or evicted past its budget, while
    serving (None: neither, or there is no local engine)."""
    faults = server.answerer.take_cache_faults()
    return faults if faults and (faults.num_failed_writes or faults.num_evicted_blocks) else None


def say_unrecorded(server: ChatServer, command: str) -> None:
    """The closing line for the answers a full store disk did not take."""
    count, reason = server.recording.unrecorded
    if count:
        say(f"kvtrace {command}: {count} answer{'' if count == 1 else 's'} not recorded: "
            f"{reason}", err=True)


def faults_json(faults: DiskFaults | None) -> dict[str, object] | None:
    if faults is None:
        return None
    return {"failed_writes": faults.num_failed_writes, "reasons": list(faults.write_reasons),
            "folder": faults.folder, "uncounted": faults.num_uncounted,
            "evicted_blocks": faults.num_evicted_blocks,
            "evicted_bytes": faults.num_evicted_bytes, "disk_budget": faults.disk_budget}


def say_cache_faults(faults: DiskFaults | None, command: str) -> None:
    """The closing lines for `cache_faults`: blocks not written, blocks evicted."""
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


def from_summary(server: ChatServer) -> dict[str, object]:
    """--json's `from` object (with --from): what the recorded part did."""
    summary = getattr(server.answerer, "summary", None)
    if summary is None:
        return {}
    stats = server.stats.get(summary.fork)
    return {"from": {**summary.to_dict(),
                     "reused_tokens": stats.cached_tokens if stats is not None else 0}}


def print_from(server: ChatServer, command: str) -> None:
    """The closing line of a --from run: "6 of 6 recorded calls answered ..."."""
    summary = getattr(server.answerer, "summary", None)
    if summary is not None:
        stats = server.stats.get(summary.fork)
        say(f"kvtrace {command}: " + summary.line(stats.cached_tokens if stats else None),
            err=True)


def summary_json(stats: dict[str, RunStats]) -> dict[str, object]:
    """What --json prints: per run written to, its calls and token counts."""
    return {"runs": {name: dataclasses.asdict(run) for name, run in stats.items()}}


def print_summary(stats: dict[str, RunStats], default: str | None = None) -> None:
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
