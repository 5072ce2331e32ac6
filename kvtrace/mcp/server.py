"""`make_server`: the MCP server over one store, its tools and resources registered.

The server is the official SDK's `MCPServer`; this module only wires
kvtrace's parts into it: the tools (tools.py, each made a tool function by
results.py), the resources (resources.py) and the instructions a client
reads when it connects. How it is reached (stdio, streamable HTTP) is
transport.py's. Tools that only read are annotated read-only; none is
destructive, since nothing recorded is ever deleted or rewritten.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

from kvtrace.mcp.models import Models
from kvtrace.mcp.resources import register_resources
from kvtrace.mcp.results import DescribeError, as_tool, library_message
from kvtrace.mcp.tools import READ_ONLY, Tools
from kvtrace.store import Store

INSTRUCTIONS = """\
kvtrace records what AI agents do (model calls, tool calls, HTTP) as steps of runs in a \
Git-like, append-only trace store, and replays runs through a local model reusing KV caches.
Addresses: RUN (a run's head), RUN@N (its Nth step, from 1), RUN~K (K steps before its head), \
or a step-id prefix.
To supervise a run: watch(run, cursor) returns its next events (pass back the cursor it \
returns); pause(run) stops its writer's appends; note(spec, text) annotates a step; \
revert(run, to) moves it back (undo brings it forward again); fork(spec, new, edit) starts a \
new run at a step, optionally an edited copy of it; resume(run) lets the writer go on.
Nothing recorded is ever lost: reverted steps stay in the reflog.
Step content over max_bytes is listed under a step's `paged`, never cut: read it with \
show_step(spec, pointer, offset), page by page.
Errors are one line, as the kvtrace command prints them; when one fails nothing was changed.
"""


def make_server(
    store: Store,
    *,
    model: str | None = None,
    cache_dir: Path,
    describe_error: DescribeError = library_message,
) -> MCPServer:
    """The MCP server over `store`.

    `model`: the model folder the replay tools load on first use (None: the
    embedded default), with its converted copy and disk KV blocks under
    `cache_dir`. `describe_error(exc, tool)` writes a tool's error as one
    line (default: the library's message, naming the tool's own arguments).
    """
    server: MCPServer = MCPServer("kvtrace", instructions=INSTRUCTIONS, version=_version(),
                                  log_level="WARNING")
    tools = Tools(store, Models(model, cache_dir=cache_dir))
    for method in tools.methods():
        name = method.__name__
        read_only = name in READ_ONLY
        server.add_tool(
            as_tool(method, describe_error), name=name, description=inspect.getdoc(method),
            annotations=ToolAnnotations(read_only_hint=read_only,
                                        destructive_hint=None if read_only else False),
        )
    register_resources(server, tools, describe_error)
    return server


def _version() -> str:
    """kvtrace's version as installed (what `serverInfo.version` says)."""
    from importlib import metadata

    try:
        return metadata.version("kvtrace")
    except metadata.PackageNotFoundError:
        return "unknown"
