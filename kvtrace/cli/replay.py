"""Replay commands: replay, checkout, continue, analyze. Each is one call of `kvtrace.replay`.

The local backend keeps its disk tier under the kvtrace cache directory
($KVTRACE_CACHE or ~/.cache/kvtrace), so `checkout` in one process warms
`continue` in the next.
"""

from __future__ import annotations

import typer

from kvtrace.cli.app import app, print_json, store_url
from kvtrace.errors import UsageError
from kvtrace.paths import default_cache_dir
from kvtrace.replay import (
    SamplingParams,
    analyze,
    checkout,
    continue_run,
    conversation_at,
    replay,
    steps_to_replay,
)
from kvtrace.replay.analyze import render_analysis
from kvtrace.replay.backend import Backend
from kvtrace.replay.remote import RemoteBackend
from kvtrace.replay.report import progress_bar, render
from kvtrace.store import open_store, validate_run_name

JSON = typer.Option(False, "--json", help="Print one JSON document for programs.")
BACKEND = typer.Option(
    "local", "--backend",
    help="'local' (the engine with its two-tier KV cache) or the base URL of an "
    "OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1.",
)
MODEL = typer.Option(
    None, "--model",
    help="Local: a transformers model folder (default: the embedded SmolLM2-135M-Instruct). "
    "Remote: the model name sent to the server (default: the recorded one).",
)
TOKENIZER = typer.Option(
    None, "--tokenizer",
    help="Remote only: a local model folder, or 'default' for the embedded model, whose "
    "tokenizer computes the oracle bound and token positions.",
)
API_KEY = typer.Option(
    None, "--api-key", envvar="KVTRACE_API_KEY",
    help="Bearer token for a remote backend ($KVTRACE_API_KEY); never recorded.",
)


def _backend(
    backend: str, model: str | None, *, no_cache: bool = False,
    tokenizer: str | None = None, api_key: str | None = None,
) -> Backend:
    from kvtrace.replay.local import load_tokenizer, open_local_backend

    if backend == "local":
        if tokenizer is not None:
            raise UsageError("--tokenizer is for remote backends: the local engine has its own")
        return open_local_backend(model, cache_dir=default_cache_dir(), use_cache=not no_cache)
    if no_cache:
        raise UsageError("--no-cache works with the local backend only")
    local_tokenizer = None
    if tokenizer is not None:
        name = None if tokenizer == "default" else tokenizer
        local_tokenizer = load_tokenizer(name, cache_dir=default_cache_dir())
    return RemoteBackend(backend, model=model, api_key=api_key, tokenizer=local_tokenizer)


@app.command("replay")
def replay_command(
    run: str = typer.Argument(..., help="The run to replay (or any step address)."),
    mode: str = typer.Option(
        "rebuild", "--mode",
        help="verify: regenerate each response and compare with the recording; "
        "rebuild: feed the recorded outputs to rebuild the KV state fast.",
    ),
    to: str = typer.Option(
        None, "--to", help="Stop at this step (RUN@N, RUN~K, id prefix); default: the head."
    ),
    backend: str = BACKEND,
    model: str = MODEL,
    tokenizer: str = TOKENIZER,
    api_key: str = API_KEY,
    no_cache: bool = typer.Option(
        False, "--no-cache", help="Compute every token (local backend): the uncached baseline."
    ),
    compare_uncached: bool = typer.Option(
        False, "--compare-uncached",
        help="Then replay again with caching off and report the speed-up.",
    ),
    no_draft: bool = typer.Option(
        False, "--no-draft",
        help="Verify: decode every response token by token instead of first checking "
        "the recorded one in a single pass (decoding's own verdicts, slower).",
    ),
    as_json: bool = JSON,
) -> None:
    """Replay a run from its root through a backend, reporting KV reuse per step."""
    if no_draft and mode != "verify":
        raise UsageError("--no-draft applies to --mode verify only")
    with open_store(store_url()) as store:
        steps_to_replay(store, run, to=to, mode=mode)  # bad input fails before a model loads
        chosen = _backend(backend, model, no_cache=no_cache, tokenizer=tokenizer,
                          api_key=api_key)
        if as_json:
            report = replay(store, run, chosen, to=to, mode=mode,
                            compare_uncached=compare_uncached, use_drafts=not no_draft)
            print_json(report.to_dict())
            return
        with progress_bar(f"{mode} {run}") as on_step:
            report = replay(store, run, chosen, to=to, mode=mode,
                            compare_uncached=compare_uncached, use_drafts=not no_draft,
                            on_step=on_step)
    render(report)
    if report.is_match is False:
        raise typer.Exit(1)


@app.command("checkout")
def checkout_command(
    spec: str = typer.Argument(..., help="The step whose KV state to rebuild (RUN, RUN@N, ...)."),
    model: str = MODEL,
    as_json: bool = JSON,
) -> None:
    """Rebuild a step's KV state into the local cache so a later continue starts warm."""
    with open_store(store_url()) as store:
        steps_to_replay(store, spec)  # bad input fails before the model loads
        chosen = _backend("local", model)
        if as_json:
            print_json(checkout(store, spec, chosen).to_dict())
            return
        with progress_bar(f"checkout {spec}") as on_step:
            report = checkout(store, spec, chosen, on_step=on_step)
    from kvtrace.engine import DEFAULT_BLOCK_SIZE
    from kvtrace.engine.maintenance import default_kv_dir

    render(report)
    typer.echo(f"KV state of {spec}: whole {DEFAULT_BLOCK_SIZE}-token blocks on disk under "
               f"{default_kv_dir(default_cache_dir())} (a later process recomputes only the "
               "tail)")


@app.command("continue")
def continue_command(
    run: str = typer.Argument(..., help="The run to continue (usually a fork)."),
    steps: int = typer.Option(..., "--steps", help="At most this many new model calls."),
    tools: str = typer.Option(
        "none", "--tools",
        help="'demo': the deterministic calculator and lookup tools of the example; "
        "'none': no tools, so a tool call stops with an error naming the tool. "
        "Other tools: register Python callables with kvtrace.replay.continue_run().",
    ),
    backend: str = BACKEND,
    model: str = MODEL,
    api_key: str = API_KEY,
    max_new_tokens: int = typer.Option(96, "--max-new-tokens", help="Tokens per response."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 means greedy."),
    seed: int = typer.Option(None, "--seed", help="Sampling seed (with --temperature > 0)."),
    as_json: bool = JSON,
) -> None:
    """Generate new steps live on a run (ReAct tool calls, see docs/replay.md) and record them."""
    from kvtrace.replay.tools import DEMO_TOOLS

    if tools not in ("demo", "none"):
        raise UsageError("--tools is 'demo' or 'none'")
    params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens)
    registered = DEMO_TOOLS if tools == "demo" else {}
    with open_store(store_url()) as store:
        if steps < 1:
            raise UsageError("continue needs --steps of at least 1")
        validate_run_name(run)
        conversation_at(store.path(run))  # bad input fails before a model loads
        chosen = _backend(backend, model, api_key=api_key)
        result = continue_run(store, run, chosen, steps=steps, tools=registered, params=params)
    if as_json:
        print_json(result.to_dict())
        return
    for step in result.new_steps:
        what = step.meta.get("tool") or step.meta.get("model", "")
        typer.echo(f"{step.depth:>4}  {step.short_id}  {step.kind:<10}  {what}")
    reused = sum(r.reused_tokens or 0 for r in result.reports)
    prompt = sum(r.prompt_tokens for r in result.reports)
    calls = len(result.reports)
    typer.echo(f"{calls} model call{'' if calls == 1 else 's'}, {reused}/{prompt} prompt tokens "
               "reused"
               + (f"; final answer: {result.final_answer}" if result.is_finished else ""))


@app.command("analyze")
def analyze_command(
    run: str = typer.Argument(..., help="The run (or step) to analyze."),
    model: str = typer.Option(
        None, "--model",
        help="Model folder whose tokenizer to use (default: the embedded model).",
    ),
    as_json: bool = JSON,
) -> None:
    """Oracle bound per step and prefix breakers, with the tokenizer only (no forward pass)."""
    from kvtrace.replay.local import load_tokenizer

    with open_store(store_url()) as store:
        if not store.path(run):  # bad input fails before the tokenizer loads
            raise UsageError(f"{run!r} has no steps to analyze: record a model call on it first")
        tokenizer = load_tokenizer(model, cache_dir=default_cache_dir())
        analysis = analyze(store, run, tokenizer)
    if as_json:
        print_json(analysis.to_dict())
        return
    render_analysis(analysis)
