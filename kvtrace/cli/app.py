"""The root Typer application, its command groups and what every command shares.

Conventions (tests/test_cli_conventions.py pins them):
- every command takes `--json` (the one `Json` option below): one JSON
  document on stdout; a command that changes something prints what it did;
- `-o FILE` never replaces an existing file unless `--force` is given
  (`kvtrace.cli.output.output_file`);
- `--store` reaches the commands through the click context object
  (`CliState`, read with `store_url()`), never through module state;
- a library error about one parameter carries its name (`KvtraceError.param`)
  and spells it `param=` in its message; `flag_message` writes that as the
  running command's flag (`to=STEP` -> `--to STEP`). The one error handler
  is `kvtrace.cli.main`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from kvtrace.errors import KvtraceError, UsageError
from kvtrace.inert import inert, inert_json

if TYPE_CHECKING:  # Typer vendors click; its command class has no public alias
    from typer._click import Command


@dataclass
class CliState:
    """What the root options decide for the whole invocation (the click context's `obj`)."""

    store_url: str | None = None
    command: Command | None = None  # the command being run: its flags name errors
    path: tuple[str, ...] = ()  # the names that led to it ("bench", "store")


class _Group(TyperGroup):
    """A command group that records which command runs, so errors can name its flags."""

    def resolve_command(
        self, ctx: typer.Context, args: list[str]  # type: ignore[override]
    ) -> tuple[str | None, Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None:
            state = ctx.ensure_object(CliState)
            state.command = command
            state.path = (*state.path, command.name or "")
        return name, command, rest


app = typer.Typer(
    name="kvtrace",
    cls=_Group,
    help="Record agent runs in a Git-like trace store; replay them reusing KV caches.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
cache_app = typer.Typer(
    cls=_Group, help="Inspect and manage the two-tier KV prefix cache.", no_args_is_help=True
)
bench_app = typer.Typer(
    cls=_Group,
    help="Benchmarks (not timed tests): figures as text, or one JSON object with --json.",
    no_args_is_help=True,
)
app.add_typer(cache_app, name="cache")
app.add_typer(bench_app, name="bench")

Json = Annotated[
    bool, typer.Option("--json", help="Print one JSON document (for programs) instead of text.")
]
# Every command that loads a model (or its tokenizer) takes it by this one option.
Model = Annotated[str | None, typer.Option(
    "--model",
    help="The model: a transformers folder or a .gguf file (default: the embedded "
    "SmolLM2-135M-Instruct). With a remote --backend, the model name sent (default: the "
    "recorded one).")]


class Precision(StrEnum):
    """The local engine's number formats whose prefill is canonical (docs/cache.md)."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


Dtype = Annotated[Precision, typer.Option(
    "--dtype",
    help="Local mode: the engine's number format. auto: bfloat16 where the CPU computes it "
    "natively (AVX-512 BF16 or AMX: about twice as fast as float32 there), else float32. "
    "bfloat16 elsewhere is ~10x slower (kvtrace warns). Each has KV of its own, never mixed.")]


@app.callback()
def _root(
    ctx: typer.Context,
    store: Annotated[str | None, typer.Option(
        "--store",
        envvar="KVTRACE_STORE",
        help="Store URL (sqlite:///PATH or postgresql://...). Default: .kvtrace/store.db "
        "in the working directory, or $KVTRACE_HOME.",
    )] = None,
) -> None:
    """Record agent runs in a Git-like trace store; replay them reusing KV caches."""
    ctx.ensure_object(CliState).store_url = store


def store_url(ctx: typer.Context) -> str | None:
    """The store URL given with `--store` or in $KVTRACE_STORE (None: the default store)."""
    state = ctx.find_object(CliState)
    return state.store_url if state is not None else None


def say(text: str, *, err: bool = False) -> None:
    """Print one line of text made inert: recorded content never drives the terminal.

    kvtrace's own words hold no control characters, so every line goes
    through `kvtrace.inert` whole (escape sequences, bidi and zero-width
    characters from a recording are shown as escapes).
    """
    typer.echo(inert(text), err=err)


def print_json(value: Any) -> None:
    """Print one JSON document (what `--json` promises)."""
    typer.echo(inert_json(json.dumps(value, indent=2, ensure_ascii=False, default=str)))


def print_json_items(items: Iterable[Any]) -> None:
    """Print a JSON array item by item, as `print_json` prints the list (same bytes).

    For a long listing: each item is printed as it is read, and memory holds one.
    """
    opened = False
    for item in items:
        text = json.dumps(item, indent=2, ensure_ascii=False, default=str)
        typer.echo(("[\n  " if not opened else ",\n  ")
                   + inert_json(text).replace("\n", "\n  "), nl=False)
        opened = True
    typer.echo("\n]" if opened else "[]")


# Where a command's option is named otherwise than the API parameter an error names.
# A library parameter that a command spells otherwise: Store.import_bundle(name=) is
# import's --run, run_verify(timeout_s=) is verify's --timeout.
_PARAM_ALIASES = {"import": {"name": "run"}, "verify": {"timeout_s": "timeout"}}


def flag_message(exc: KvtraceError, command: Command | None) -> str:
    """The error's message, its parameter written as `command`'s flag (`to=X` -> `--to X`)."""
    message = str(exc)
    if exc.param is None or command is None:
        return message
    name = _PARAM_ALIASES.get(command.name or "", {}).get(exc.param, exc.param)
    option = next((p for p in command.params
                   if p.param_type_name == "option" and p.name == name), None)
    if option is None:
        return message
    flag = next((o for o in option.opts if o.startswith("--")), option.opts[0])
    spelled = rf"(?<![\w.]){re.escape(exc.param)}="
    if getattr(option, "is_flag", False):
        message = re.sub(spelled + r"True\b", flag, message)
    return re.sub(spelled, f"{flag} ", message)


def announce_conversion(message: str) -> None:
    """Say on stderr, once, that a slow one-time model conversion starts and why.

    Passed as `on_convert` to `load_tokenizer` / `load_engine`; transformers'
    own progress bars are turned off, the line says it all.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    say(f"kvtrace: {message}", err=True)


def read_edit(path: str) -> dict[str, Any]:
    """An `--edit FILE`: a JSON object mapping a step's content fields to new values."""
    import json
    from pathlib import Path

    try:
        changes = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--edit {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise UsageError(f"--edit {path}: not a JSON object ({exc})") from exc
    if not isinstance(changes, dict):
        raise UsageError(f"--edit {path}: not a JSON object of fields")
    return changes
