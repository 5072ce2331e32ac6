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

import typer

from kvtrace.cli import (  # noqa: F401  (registers commands)
    bench,
    cache,
    page,
    replay,
    serve,
    store_commands,
)
from kvtrace.cli.app import CliState, app, flag_message
from kvtrace.errors import KvtraceError


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    state = CliState()
    try:
        result = app(args=argv, standalone_mode=False, obj=state)
    except KvtraceError as exc:
        print(f"error: {flag_message(exc, state.command)}", file=sys.stderr)
        sys.exit(2)
    except typer.TyperException as exc:  # click's usage errors, as vendored by Typer
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # type: ignore[attr-defined]
            sys.exit(0)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        print(f"error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2))
    except OSError as exc:  # a file the user named cannot be read or written
        print(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:  # the last line of defence: a bug, but still one line
        if os.environ.get("KVTRACE_DEBUG"):
            raise
        reason = " ".join(str(exc).split())[:500]
        print(f"error: unexpected {type(exc).__name__}: {reason} (a bug in kvtrace: please "
              "report it; KVTRACE_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(1)
    sys.exit(result if isinstance(result, int) else 0)
