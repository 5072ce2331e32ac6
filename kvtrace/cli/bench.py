"""`kvtrace bench ...`: benchmarks, each printing one JSON object.

Benchmarks are measurements, never timed tests: each runs the compared cases
side by side in one process and reports medians and ratios. The logic lives in
`kvtrace.bench`; heavy imports happen inside each command.
"""

from __future__ import annotations

import typer

from kvtrace.cli.app import bench_app, print_json


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
