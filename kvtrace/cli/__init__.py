"""The `kvtrace` command: a thin layer over the public Python API.

Each command parses its arguments, makes one call of the API and prints the
result (text by default, JSON with `--json`). Every `KvtraceError` and every
usage mistake becomes one line on stderr and exit code 2; nothing is
half-written because the API itself is transactional. A library error names
the Python parameter it is about (`to=STEP`); this handler writes it as the
running command's flag (`--to STEP`, see `kvtrace.cli.app.flag_message`).
Anything else is a bug of kvtrace: the last line of defence prints it as one
`error:` line naming the exception type, and exits 1 (`KVTRACE_DEBUG=1` shows
the traceback).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import NoReturn, TextIO

import typer

from kvtrace.cli import (  # noqa: F401  (registers commands)
    bench,
    cache,
    mcp,
    page,
    record,
    replay,
    serve,
    store_commands,
    ui,
    workspace,
)
from kvtrace.cli.app import CliState, app, flag_message
from kvtrace.errors import KvtraceError
from kvtrace.extras import missing_extra
from kvtrace.inert import inert


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    state = CliState()
    warnings.showwarning = _warning
    try:
        result = app(args=argv, standalone_mode=False, obj=state)
    except KvtraceError as exc:
        _error(flag_message(exc, state.command))
        sys.exit(2)
    except typer.TyperException as exc:  # click's usage errors, as vendored by Typer
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # type: ignore[attr-defined]
            sys.exit(0)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        _error(_placed_before(exc, argv) or " ".join(message.split()))
        sys.exit(getattr(exc, "exit_code", 2))
    except OSError as exc:  # a file the user named cannot be read or written
        _error(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
        sys.exit(2)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except ModuleNotFoundError as exc:  # a part of kvtrace this install left out, or a bug
        line = missing_extra(exc, " ".join(state.path) or None)
        if line is None:
            _unexpected(exc)
        _error(line)
        sys.exit(2)
    except Exception as exc:  # the last line of defence: a bug, but still one line
        _unexpected(exc)
    sys.exit(result if isinstance(result, int) else 0)


def _unexpected(exc: Exception) -> NoReturn:
    """The last line of defence: a bug, but still one line (KVTRACE_DEBUG=1 raises it)."""
    if os.environ.get("KVTRACE_DEBUG"):
        raise exc
    reason = " ".join(str(exc).split())[:500]
    _error(f"unexpected {type(exc).__name__}: {reason} (a bug in kvtrace: please "
           "report it; KVTRACE_DEBUG=1 shows the traceback)")
    sys.exit(1)


def _placed_before(exc: Exception, argv: list[str] | None) -> str | None:
    """For an option of kvtrace's own (`--store`) given after the command: where it goes."""
    name = getattr(exc, "option_name", None)
    root = typer.main.get_command(app)
    if type(exc).__name__ != "NoSuchOption" or not any(
            name in param.opts for param in root.params):
        return None
    args = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args if not a.startswith("-")), "COMMAND")
    return (f"{name} is an option of kvtrace itself: it goes before the command "
            f"(kvtrace {name} VALUE {command} ...)")


def _warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
    """kvtrace's own warnings as one `warning:` line (the default adds a path and a source line);
    other libraries' keep the default form."""
    if f"{os.sep}kvtrace{os.sep}" not in filename:
        _show_warning(message, category, filename, lineno, file, line)
        return
    print(f"warning: {inert(str(message), keep_newlines=False)}", file=file or sys.stderr)


_show_warning = warnings.showwarning


def _error(message: str) -> None:
    """The one `error:` line (messages may quote recorded content: shown inert, on one line)."""
    print(f"error: {inert(message, keep_newlines=False)}", file=sys.stderr)
