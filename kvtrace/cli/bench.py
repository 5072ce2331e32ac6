"""`kvtrace bench ...`: benchmarks, printing their figures as text or, with `--json`, as one
JSON object (what bench/run_all.sh keeps and docs/benchmarks.md quotes).

Benchmarks are measurements, never timed tests: each runs the compared cases
side by side in one process and reports medians and ratios. The logic lives in
`kvtrace.bench`; heavy imports happen inside each command.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvtrace.cli.app import Json, bench_app, print_json, store_url
from kvtrace.errors import UsageError

Model = Annotated[str | None, typer.Option(
    "--model", help="Model folder (default: the embedded SmolLM2-135M-Instruct).")]


def _print_figures(figures: dict[str, Any], as_json: bool) -> None:
    """The one JSON object, or one `name  value` line per figure (nested names dotted)."""
    if as_json:
        print_json(figures)
        return
    rows = list(_flat(figures))
    width = max((len(name) for name, _ in rows), default=0)
    for name, value in rows:
        typer.echo(f"{name:<{width}}  {value}")


def _flat(value: Any, prefix: str = "") -> Any:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        for index, item in enumerate(value):
            yield from _flat(item, f"{prefix}[{index}]")
    elif isinstance(value, list):
        yield prefix, ", ".join(str(item) for item in value)
    else:
        yield prefix, value


@bench_app.command("store")
def bench_store(
    url: Annotated[str | None, typer.Option(
        "--url", help="Store URL to measure (default: a temp SQLite file).")] = None,
    num_appends: Annotated[int, typer.Option(
        "--appends", help="Number of appends to time.")] = 2000,
    as_json: Json = False,
) -> None:
    """Append latency, and fork/revert time at 10 vs 10,000 steps."""
    from kvtrace.bench.store import run_store_bench

    _print_figures(run_store_bench(url, num_appends=num_appends), as_json)


@bench_app.command("appends")
def bench_appends(
    urls: Annotated[list[str] | None, typer.Argument(
        help="Store URLs to compare, e.g. sqlite:///a.db?synchronous=full or "
        "postgresql://...?options=-csynchronous_commit%3Doff (default: two temp SQLite "
        "files, synchronous=normal and synchronous=full).")] = None,
    num_appends: Annotated[int, typer.Option(
        "--appends", help="Appends to time per store.")] = 1000,
    as_json: Json = False,
) -> None:
    """Append latency of several stores side by side, taking turns."""
    from kvtrace.bench.store import run_append_comparison

    _print_figures(run_append_comparison(urls or None, num_appends=num_appends), as_json)


@bench_app.command("replay")
def bench_replay(
    ctx: typer.Context,
    model: Model = None,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Record the benchmark run again instead of reusing it.")] = False,
    trials: Annotated[int, typer.Option(
        "--trials", help="Runs per timed case (the fastest counts).")] = 2,
    shape: Annotated[str, typer.Option(
        "--shape",
        help="Fixture: session (14-call ReAct session) or agent (30 calls, 1.6k to 5k+ "
        "tokens).")] = "session",
    run: Annotated[str | None, typer.Option(
        "--run", help="Measure this run of the store (--store) instead of a fixture.")] = None,
    calls: Annotated[int | None, typer.Option(
        "--calls", min=1,
        help="Model calls of the agent fixture (default 30; fewer is faster).")] = None,
    no_verify: Annotated[bool, typer.Option(
        "--no-verify", help="Skip the verify cases and their decoding bound.")] = False,
    as_json: Json = False,
) -> None:
    """Replay an agent run every way: hit rate vs oracle, speed-up, bounds, peak RSS."""
    from kvtrace.bench.replay import run_replay_bench
    from kvtrace.paths import default_cache_dir

    _print_figures(
        run_replay_bench(cache_dir=default_cache_dir(), model=model, fresh=fresh, trials=trials,
                         shape=shape, run=run, store_url=store_url(ctx), calls=calls,
                         with_verify=not no_verify),
        as_json,
    )


@bench_app.command("cache")
def bench_cache(
    model: Model = None,
    num_tokens: Annotated[int, typer.Option(
        "--tokens", help="Prompt length of the cold prefill.")] = 2048,
    num_new: Annotated[int, typer.Option(
        "--new", help="New tokens after the cached prefix.")] = 32,
    repeats: Annotated[int, typer.Option(
        "--repeats", help="Runs per case (the median is reported).")] = 3,
    as_json: Json = False,
) -> None:
    """Prefill: cold vs prefix from memory vs from disk, KV bytes per token."""
    from kvtrace.bench.cache import run_cache_bench
    from kvtrace.paths import default_cache_dir

    _print_figures(
        run_cache_bench(
            cache_dir=default_cache_dir(),
            model=model,
            num_tokens=num_tokens,
            num_new=num_new,
            repeats=repeats,
        ),
        as_json,
    )


@bench_app.command("serve")
def bench_serve(
    model: Model = None,
    num_requests: Annotated[int, typer.Option(
        "--requests", help="Chat requests extending one conversation (local mode).")] = 20,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", help="Tokens generated per request.")] = 16,
    num_rounds: Annotated[int, typer.Option(
        "--rounds",
        help="Times the conversation is sent through --upstream, recording and not.")] = 10,
    as_json: Json = False,
) -> None:
    """Latency and cached-token fraction through kvtrace serve, and recording's overhead."""
    from kvtrace.bench.serve import run_serve_bench
    from kvtrace.paths import default_cache_dir

    if num_requests < 1 or max_tokens < 1 or num_rounds < 1:
        raise UsageError("--requests, --max-tokens and --rounds must be >= 1")
    _print_figures(run_serve_bench(cache_dir=default_cache_dir(), model=model,
                                   num_requests=num_requests, max_tokens=max_tokens,
                                   num_rounds=num_rounds), as_json)


@bench_app.command("fork")
def bench_fork(
    model: Model = None,
    calls: Annotated[int, typer.Option("--calls", min=2, help="Model calls of the agent.")] = 10,
    k: Annotated[int, typer.Option(
        "--k", min=1, help="Answer calls 1..K from the recording (--from base@K).")] = 6,
    trials: Annotated[int, typer.Option(
        "--trials", min=1, help="Runs per case, alternating (the fastest counts).")] = 2,
    n: Annotated[int | None, typer.Option(
        "--n", min=1,
        help="Instead: N agent processes (record --from base@K --n N) and N branches (branch "
        "--n N) decoded together, against the same N one after another: tokens per second.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", min=1, help="With --n: tokens per answer (the agents' max_tokens, the "
        "branches' max_new_tokens).")] = 96,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="With --n: sampling temperature (agent i, branch i: seed i-1).")
    ] = 0.8,
    steps: Annotated[int, typer.Option(
        "--steps", min=1, help="With --n: model calls per branch.")] = 2,
    case: Annotated[str, typer.Option(
        "--case", help="With --n: 'agents', 'branch' or 'both'.")] = "both",
    as_json: Json = False,
) -> None:
    """An agent forked at step K (--from) against re-running it whole, on the local engine;
    with --n, K experiments at once against one after another."""
    if k >= calls:
        raise typer.BadParameter(f"--k must be below --calls ({calls})", param_hint="--k")
    if case not in ("agents", "branch", "both"):
        raise typer.BadParameter(f"{case!r}: 'agents', 'branch' or 'both'", param_hint="--case")
    if n is not None:
        from kvtrace.bench.experiments import CASES, run_experiments_bench

        _print_figures(run_experiments_bench(
            model=model, n=n, calls=calls, k=k, max_tokens=max_tokens, temperature=temperature,
            steps=steps, trials=trials, cases=CASES if case == "both" else (case,)), as_json)
        return
    from kvtrace.bench.fork import run_fork_bench

    _print_figures(run_fork_bench(model=model, calls=calls, k=k, trials=trials), as_json)
