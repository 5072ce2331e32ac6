"""`kvtrace report`: the HTML report of runs (one call of `kvtrace.page.write_report`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvtrace.cli.app import Json, Model, announce_conversion, app, print_json, say, store_url
from kvtrace.cli.output import Force, check_output, output_file
from kvtrace.cli.progress import step_bar
from kvtrace.errors import UsageError
from kvtrace.paths import default_cache_dir
from kvtrace.store import open_store

if TYPE_CHECKING:
    from kvtrace.engine import ChatTokenizer


@app.command("report")
def report_command(
    ctx: typer.Context,
    runs: Annotated[list[str], typer.Argument(
        help="Runs (or step addresses) to show, in order.")],
    output: Annotated[Path, typer.Option(
        "-o", "--output", help="HTML file to write (an existing one only with --force).")],
    model: Model = None,
    no_tokens: Annotated[bool, typer.Option(
        "--no-tokens",
        help="Load no tokenizer: no oracle-bound bars (the provider's cached tokens still "
        "show where recorded).")] = False,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Write one self-contained HTML page: branch graph, steps, token bars, notes."""
    from kvtrace.page import write_report

    if no_tokens and model is not None:
        raise UsageError("--model names the tokenizer to count with: drop it or --no-tokens")
    check_output(output, force=force)  # before a tokenizer loads
    with open_store(store_url(ctx), create=False) as store:
        for run in runs:
            store.resolve(run)  # an unknown run is one error line before a tokenizer loads
        tokenizer = None if no_tokens else _tokenizer(model)
        with output_file(output, force=force) as tmp, step_bar("report") as on_step:
            page = write_report(store, runs, tmp, tokenizer=tokenizer,
                                tokenizer_name=tokenizer.name if tokenizer else None,
                                on_step=on_step)
    num_steps = sum(len(run.steps) for run in page.runs)
    num_forks = len(page.lanes) - len(page.runs)
    if as_json:
        print_json({"path": str(output), "runs": list(runs), "num_steps": num_steps,
                    "num_forks": num_forks, "tokenizer": page.tokenizer})
        return
    say(f"wrote {output}: {len(page.runs)} run(s), {num_steps} steps"
               + (f", {num_forks} fork(s) in the graph" if num_forks else ""))


def _tokenizer(model: str | None) -> ChatTokenizer:
    from kvtrace.engine import load_tokenizer

    return load_tokenizer(model, cache_dir=default_cache_dir(), on_convert=announce_conversion)
