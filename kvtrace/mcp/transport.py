"""How a client reaches the MCP server: stdio, or streamable HTTP on loopback or with a key.

- stdio: the client starts `kvtrace mcp` and speaks JSON-RPC on its stdin
  and stdout (how Claude Code and most clients run a local server); only
  that client can reach it.
- streamable HTTP (`POST /mcp`): served by uvicorn on 127.0.0.1 by default,
  where the SDK also checks the Host and Origin headers (a web page cannot
  reach it by DNS rebinding). With `api_key`, every request needs
  `Authorization: Bearer KEY` (401 with a JSON-RPC error body otherwise), as
  `kvtrace serve` asks; an address other than loopback is refused without
  one. The key is checked in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from mcp.server.mcpserver import MCPServer
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvtrace.errors import UsageError
from kvtrace.serve.app import check_api_key
from kvtrace.serve.runner import BackgroundServer, is_loopback

MCP_PATH = "/mcp"
UNAUTHORIZED = -32001  # a JSON-RPC server error code (-32000 to -32099 are the server's)


def serve_stdio(server: MCPServer) -> None:
    """Serve one client on stdin and stdout until it closes them."""
    server.run("stdio")


def http_app(server: MCPServer, *, host: str = "127.0.0.1", api_key: str | None = None) -> Any:
    """The ASGI application of the streamable HTTP transport, behind the key if one is given."""
    check_api_key(api_key)
    if api_key is None and not is_loopback(host):
        raise UsageError(f"host={host} lets other machines reach the server: give api_key=KEY "
                         "too, or keep the default 127.0.0.1", param="api_key")
    app = server.streamable_http_app(streamable_http_path=MCP_PATH, host=host)
    return app if api_key is None else RequireKey(app, api_key)


def serve_http(
    server: MCPServer,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve streamable HTTP until SIGINT or SIGTERM; `on_ready(url)` once it listens."""
    running = BackgroundServer(http_app(server, host=host, api_key=api_key), host=host,
                               port=port).start()
    if on_ready is not None:
        on_ready(f"http://{running.host}:{running.port}{MCP_PATH}")
    running.wait()


class RequireKey:
    """ASGI middleware: an HTTP request without `Authorization: Bearer KEY` gets a 401."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_authorized(scope):
            await self.app(scope, receive, send)
            return
        given = any(name == b"authorization" for name, _ in scope.get("headers", []))
        what = "the bearer token is wrong" if given else "no bearer token was sent"
        message = (f"{what}: send 'Authorization: Bearer KEY' with the key kvtrace mcp was "
                   "started with (--api-key)")
        # A JSON-RPC error body: an MCP client shows its message, not just "401".
        refusal = JSONResponse(
            {"jsonrpc": "2.0", "id": None,
             "error": {"code": UNAUTHORIZED, "message": message,
                       "data": {"reason": "invalid_api_key"}}},
            status_code=401, headers={"WWW-Authenticate": 'Bearer realm="kvtrace mcp"'})
        await refusal(scope, receive, send)

    def _is_authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(),
                                                                           self._key)
        return False
