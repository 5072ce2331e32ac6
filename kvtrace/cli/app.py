"""The root Typer application, its command groups and shared CLI helpers."""

from __future__ import annotations

import json
from typing import Any

import typer

app = typer.Typer(
    name="kvtrace",
    help="Record agent runs in a Git-like trace store; replay them reusing KV caches.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
cache_app = typer.Typer(
    help="Inspect and manage the two-tier KV prefix cache.", no_args_is_help=True
)
bench_app = typer.Typer(
    help="Benchmarks (not timed tests): each prints one JSON object.", no_args_is_help=True
)
app.add_typer(cache_app, name="cache")
app.add_typer(bench_app, name="bench")

_state: dict[str, Any] = {"store_url": None}


@app.callback()
def _root(
    store: str = typer.Option(
        None,
        "--store",
        envvar="KVTRACE_STORE",
        help="Store URL (sqlite:///PATH or postgresql://...). Default: .kvtrace/store.db "
        "in the working directory, or $KVTRACE_HOME.",
    ),
) -> None:
    """Record agent runs in a Git-like trace store; replay them reusing KV caches."""
    _state["store_url"] = store


def store_url() -> str | None:
    """The store URL given on the command line or in $KVTRACE_STORE."""
    return _state["store_url"]


def print_json(value: Any) -> None:
    """Print one JSON document (what `--json` promises)."""
    typer.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def announce_conversion(message: str) -> None:
    """Say on stderr, once, that a slow one-time model conversion starts and why.

    Passed as `on_convert` to `load_tokenizer` / `load_engine`; transformers'
    own progress bars are turned off, the line says it all.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    typer.echo(f"kvtrace: {message}", err=True)
