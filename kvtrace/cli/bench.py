"""`kvtrace bench ...`: benchmarks, each printing one JSON object.

Benchmarks are measurements, never timed tests: each runs the compared cases
side by side in one process and reports medians and ratios. The logic lives in
`kvtrace.bench`; heavy imports happen inside each command.
"""

from __future__ import annotations

import typer

from kvtrace.cli.app import bench_app, print_json, store_url


@bench_app.command("store")
def bench_store(
    url: str = typer.Option(
        None, "--url", help="Store URL to measure (default: a temp SQLite file)."
    ),
    num_appends: int = typer.Option(2000, "--appends", help="Number of appends to time."),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (the default output is JSON too)."
    ),
) -> None:
    """Append latency, and fork/revert time at 10 vs 10,000 steps (one JSON object)."""
    from kvtrace.bench.store import run_store_bench

    print_json(run_store_bench(url, num_appends=num_appends))


@bench_app.command("appends")
def bench_appends(
    urls: list[str] = typer.Argument(
        None,
        help="Store URLs to compare, e.g. sqlite:///a.db?synchronous=full or "
        "postgresql://...?options=-csynchronous_commit%3Doff (default: two temp SQLite "
        "files, synchronous=normal and synchronous=full).",
    ),
    num_appends: int = typer.Option(1000, "--appends", help="Appends to time per store."),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (the default output is JSON too)."
    ),
) -> None:
    """Append latency of several stores side by side, taking turns (one JSON object)."""
    from kvtrace.bench.store import run_append_comparison

    print_json(run_append_comparison(urls or None, num_appends=num_appends))


@bench_app.command("replay")
def bench_replay(
    model: str = typer.Option(
        None, "--model", help="Model folder (default: the embedded SmolLM2-135M-Instruct)."
    ),
    fresh: bool = typer.Option(
        False, "--fresh", help="Record the benchmark run again instead of reusing it."
    ),
    trials: int = typer.Option(2, "--trials", help="Runs per timed case (the fastest counts)."),
    shape: str = typer.Option(
        "session", "--shape",
        help="Fixture: session (14-call ReAct session) or agent (30 calls, 1.6k to 5k+ tokens).",
    ),
    run: str = typer.Option(
        None, "--run", help="Measure this run of the store (--store) instead of a fixture."
    ),
    calls: int = typer.Option(
        None, "--calls", min=1,
        help="Model calls of the agent fixture (default 30; fewer is faster).",
    ),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="Skip the verify cases and their decoding bound."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (the default output is JSON too)."
    ),
) -> None:
    """Replay an agent run every way: hit rate vs oracle, speed-up, bounds, peak RSS."""
    from kvtrace.bench.replay import run_replay_bench
    from kvtrace.paths import default_cache_dir

    print_json(
        run_replay_bench(cache_dir=default_cache_dir(), model=model, fresh=fresh, trials=trials,
                         shape=shape, run=run, store_url=store_url(), calls=calls,
                         with_verify=not no_verify)
    )


@bench_app.command("cache")
def bench_cache(
    model: str = typer.Option(
        None, "--model", help="Model folder (default: the embedded SmolLM2-135M-Instruct)."
    ),
    num_tokens: int = typer.Option(2048, "--tokens", help="Prompt length of the cold prefill."),
    num_new: int = typer.Option(32, "--new", help="New tokens after the cached prefix."),
    repeats: int = typer.Option(3, "--repeats", help="Runs per case (the median is reported)."),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (the default output is JSON too)."
    ),
) -> None:
    """Prefill: cold vs prefix from memory vs from disk, KV bytes per token (one JSON object)."""
    from kvtrace.bench.cache import run_cache_bench
    from kvtrace.paths import default_cache_dir

    print_json(
        run_cache_bench(
            cache_dir=default_cache_dir(),
            model=model,
            num_tokens=num_tokens,
            num_new=num_new,
            repeats=repeats,
        )
    )


@bench_app.command("serve")
def bench_serve(
    model: str = typer.Option(
        None, "--model", help="Model folder (default: the embedded SmolLM2-135M-Instruct)."
    ),
    num_requests: int = typer.Option(
        20, "--requests", help="Chat requests extending one conversation (local mode)."
    ),
    max_tokens: int = typer.Option(16, "--max-tokens", help="Tokens generated per request."),
    num_rounds: int = typer.Option(
        10, "--rounds", help="Times the conversation is sent through --upstream, recording and not."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (the default output is JSON too)."
    ),
) -> None:
    """Latency and cached-token fraction through kvtrace serve, and recording's overhead."""
    from kvtrace.bench.serve import run_serve_bench
    from kvtrace.errors import UsageError
    from kvtrace.paths import default_cache_dir

    if num_requests < 1 or max_tokens < 1 or num_rounds < 1:
        raise UsageError("--requests, --max-tokens and --rounds must be >= 1")
    print_json(run_serve_bench(cache_dir=default_cache_dir(), model=model,
                               num_requests=num_requests, max_tokens=max_tokens,
                               num_rounds=num_rounds))
