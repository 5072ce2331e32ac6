"""`kvtrace mcp`: the trace store as an MCP server, for supervising agents (docs/mcp.md).

Built on the official `mcp` SDK (`MCPServer`), one module per concept:

- tools.py: the tools, each one call of kvtrace's public API returning
  the JSON its CLI twin prints with `--json`;
- results.py: a tool's result (structured JSON) or error (one line, as the
  CLI prints it; nothing changed);
- paging.py: step content within a byte budget, the rest read page by page;
- resources.py: runs and steps by address (`kvtrace://run/…`, `kvtrace://step/…`);
- models.py: the model the replay tools load on first use;
- server.py: `make_server`, wiring the above into one `MCPServer`;
- transport.py: stdio, or streamable HTTP (loopback, or a bearer key).

    from kvtrace import open_store
    from kvtrace.mcp import make_server, serve_stdio

    serve_stdio(make_server(open_store(), cache_dir=Path("~/.cache/kvtrace").expanduser()))

Recorded strings are data: tools return them as recorded. What is text for
a person (an error line, a step's one-line summary) is made inert.
"""

from __future__ import annotations

from kvtrace.mcp.server import INSTRUCTIONS, make_server
from kvtrace.mcp.transport import MCP_PATH, http_app, serve_http, serve_stdio

__all__ = ["INSTRUCTIONS", "MCP_PATH", "http_app", "make_server", "serve_http", "serve_stdio"]
