"""`kvtrace mcp`: the store as an MCP server (kvtrace.mcp), over stdio or streamable HTTP.

A tool that has a CLI twin (`show_step` is `kvtrace show`, ...) fails with
the line that command prints, its flags named (`flag_message`): an agent
reading the error and a person reading the CLI's see one message.
With `--json` (HTTP only: stdio's stdout is the MCP channel), the server's
URL is one JSON object on stdout as soon as it listens, for a program that
started it on port 0.
"""

from __future__ import annotations

import functools
import os
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer
import typer.main

from kvtrace.cli.app import Json, Model, app, flag_message, print_json, say, store_url
from kvtrace.errors import KvtraceError, UsageError
from kvtrace.paths import default_cache_dir
from kvtrace.store import open_store

if TYPE_CHECKING:
    from typer._click import Command

API_KEY_ENV = "KVTRACE_MCP_API_KEY"
DEFAULT_PORT = 8765

# Tools whose errors are written as their CLI twin's (the tool's arguments are its flags).
_CLI_TWINS = {"list_runs": "runs", "log": "log", "show_step": "show", "diff": "diff",
              "analyze": "analyze", "note": "note", "revert": "revert", "undo": "undo",
              "fork": "fork", "replay": "replay", "branch": "branch"}


class Transport(StrEnum):
    """How clients reach the server."""

    STDIO = "stdio"  # the client starts kvtrace mcp and speaks on its stdin and stdout
    HTTP = "http"  # streamable HTTP at http://HOST:PORT/mcp


@app.command("mcp")
def mcp_command(
    ctx: typer.Context,
    transport: Annotated[Transport, typer.Option(
        "--transport",
        help="stdio: the MCP client starts this command and speaks on its stdin and stdout; "
        "http: streamable HTTP at http://HOST:PORT/mcp.")] = Transport.STDIO,
    host: Annotated[str, typer.Option(
        "--host", help="HTTP: address to listen on (loopback only by default; another needs "
        "--api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", help="HTTP: port to listen on (0: any free port).")] = DEFAULT_PORT,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=API_KEY_ENV,
        help="HTTP: require 'Authorization: Bearer KEY' from clients ($KVTRACE_MCP_API_KEY); "
        "needed with a --host other than loopback.")] = None,
    model: Model = None,
    as_json: Json = False,
) -> None:
    """An MCP server over the store: tools and resources to watch, steer and replay runs
    (see docs/mcp.md)."""
    from kvtrace.mcp import make_server, serve_http, serve_stdio
    from kvtrace.serve.app import check_api_key
    from kvtrace.serve.runner import is_loopback

    if transport is Transport.STDIO:
        if as_json or api_key is not None:
            raise UsageError(f"{'--json' if as_json else '--api-key'} applies to --transport "
                             "http (with stdio, only the client that started the server "
                             "reaches it, and stdout is its channel)")
    else:
        if not 0 <= port <= 65535:
            raise UsageError(f"--port {port} is not a port number (0-65535)")
        if api_key is None and os.environ.get(API_KEY_ENV) == "":
            raise UsageError(f"${API_KEY_ENV} is set but empty: set it to the key clients "
                             "must send, or unset it to serve without one")
        check_api_key(api_key, "--api-key")
        if api_key is None and not is_loopback(host):
            raise UsageError(f"--host {host} lets other machines reach the server: give "
                             f"--api-key KEY (or ${API_KEY_ENV}) too, or keep the default "
                             "127.0.0.1")
    with open_store(store_url(ctx), create=False) as store:
        server = make_server(store, model=model, cache_dir=default_cache_dir(),
                             describe_error=cli_message)
        if transport is Transport.STDIO:
            serve_stdio(server)
            return

        def ready(url: str) -> None:
            if as_json:
                print_json({"transport": str(transport), "url": url})
            say(f"kvtrace mcp: {url} over {store.display_url}"
                + (" (bearer key required)" if api_key else "") + "; Ctrl-C stops", err=True)

        serve_http(server, host=host, port=port, api_key=api_key, on_ready=ready)


def cli_message(exc: KvtraceError, tool: str) -> str:
    """A tool's error as its CLI twin prints it, the tool's arguments named as the flags."""
    twin = _CLI_TWINS.get(tool)
    return flag_message(exc, _commands().get(twin) if twin else None)


@functools.cache
def _commands() -> dict[str, Command]:
    """The CLI's commands by name (built once, at the first error)."""
    return dict(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
