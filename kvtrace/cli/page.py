"""`kvtrace report`: the HTML report of runs (one call of `kvtrace.page.write_report`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvtrace.cli.app import announce_conversion, app, store_url
from kvtrace.errors import UsageError
from kvtrace.paths import default_cache_dir
from kvtrace.store import open_store

if TYPE_CHECKING:
    from kvtrace.engine import ChatTokenizer


@app.command("report")
def report_command(
    runs: list[str] = typer.Argument(..., help="Runs (or step addresses) to show, in order."),
    output: Path = typer.Option(
        ..., "-o", "--output", help="HTML file to write (replaced if it exists)."),
    model: str = typer.Option(
        None, "--model",
        help="Model folder whose tokenizer counts the oracle bound (default: the embedded "
        "model's)."),
    no_tokens: bool = typer.Option(
        False, "--no-tokens",
        help="Load no tokenizer: no oracle-bound bars (the provider's cached tokens still "
        "show where recorded)."),
) -> None:
    """Write one self-contained HTML page: branch graph, steps, token bars, notes."""
    from kvtrace.page import write_report

    if no_tokens and model is not None:
        raise UsageError("--model names the tokenizer to count with: drop it or --no-tokens")
    if not output.parent.is_dir():
        raise UsageError(f"folder {output.parent} does not exist")
    if output.is_dir():
        raise UsageError(f"{output} is a folder: name the HTML file to write")
    with open_store(store_url(), create=False) as store:
        for run in runs:
            store.resolve(run)  # an unknown run is one error line before a tokenizer loads
        tokenizer = None if no_tokens else _tokenizer(model)
        page = write_report(store, runs, output, tokenizer=tokenizer,
                            tokenizer_name=tokenizer.name if tokenizer else None)
    steps = sum(len(run.steps) for run in page.runs)
    forks = len(page.lanes) - len(page.runs)
    typer.echo(f"wrote {output}: {len(page.runs)} run(s), {steps} steps"
               + (f", {forks} fork(s) in the graph" if forks else ""))


def _tokenizer(model: str | None) -> ChatTokenizer:
    from kvtrace.engine import load_tokenizer

    return load_tokenizer(model, cache_dir=default_cache_dir(), on_convert=announce_conversion)
