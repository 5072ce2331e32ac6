"""K agents against one server: `kvtrace record --from RUN@K --n K`.

One server, one engine and one decode batcher answer K copies of an
unchanged agent at once. Each copy tells the server who it is by its base
URL, the only thing an unchanged agent lets us choose: agent i talks to
`http://HOST:PORT/a/i/v1` (`OPENAI_BASE_URL`; `ANTHROPIC_BASE_URL` is
`.../a/i`). `AgentRoutes`, an ASGI wrapper in front of the server's app,
takes the `/a/i` off the path (so the server, the recording and the match
against the recorded run see the usual `/v1/...`) and puts the `Agent` in
the request's scope, where three parts read it (`agent_of`):

- the recording (recording.py): agent i's steps go on its own fork,
  whatever `X-Kvtrace-Run` says;
- the recorded prefix (fromrun.py): each agent is answered from the
  recording on its own, up to where it parts, then live;
- the local engine (local.py): a sampled request that sends no seed is
  sampled with the agent's seed (S + i - 1), recorded as the seed the
  server chose, so the K runs differ and each is reproducible.

Why a path and not a port per agent: one port keeps one event loop, one
store writer and one answerer (the queue and the batcher see every
request); and not a header or key, which an unchanged agent cannot send.
A path `/a/N/...` for no agent N is a 404; paths without the prefix
(`/health`, `/openapi.json`) are the server's own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from kvtrace.errors import UsageError
from kvtrace.store import Store, validate_run_name
from kvtrace.store.names import numbered_names

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.types import ASGIApp, Receive, Scope, Send

MAX_AGENTS = 64
SCOPE_KEY = "kvtrace.agent"
_PREFIX = re.compile(r"^/a/([0-9]{1,6})(/.*)?$")


@dataclass(frozen=True, slots=True)
class Agent:
    """One of the K copies: its number (1..K), its fork, its seed, its working folder."""

    index: int
    fork: str
    seed: int
    workdir: Path | None = None

    def base_url(self, server_url: str) -> str:
        """Its OpenAI base URL on the server whose base URL (with /v1) is `server_url`."""
        return f"{server_url.removesuffix('/v1')}/a/{self.index}/v1"


def make_agents(store: Store, base: str, n: int, *, seed: int = 0,
                workdir: str | None = None) -> list[Agent]:
    """K agents: forks `base-1` ... `base-K` (numbers a run has taken are skipped), seeds
    `seed` ... `seed + K - 1`, and folders `workdir` with `{i}` replaced by the number
    (needed when K > 1, or they would share one), made absolute; checked, nothing created."""
    if not 1 <= n <= MAX_AGENTS:
        raise UsageError(f"--n {n}: run between 1 and {MAX_AGENTS} agents", param="n")
    if workdir is not None and n > 1 and "{i}" not in workdir:
        raise UsageError(f"--workdir {workdir!r} has no {{i}}: {n} agents would share one "
                         "folder (e.g. --workdir 'runs/agent-{i}')", param="workdir")
    validate_run_name(base)
    names = numbered_names(base, n, store.has_run)
    return [Agent(index, name, seed + index - 1,
                  Path(workdir.replace("{i}", str(index))).resolve() if workdir else None)
            for index, name in enumerate(names, start=1)]


def agent_of(request: Request) -> Agent | None:
    """The agent a request came from (its `/a/i` path), or None."""
    agent = request.scope.get(SCOPE_KEY)
    return agent if isinstance(agent, Agent) else None


class AgentRoutes:
    """An ASGI wrapper: `/a/i/...` is the app's `/...`, asked by agent i (module docstring)."""

    def __init__(self, app: ASGIApp, agents: Sequence[Agent]) -> None:
        self.app = app
        self.agents = {agent.index: agent for agent in agents}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        match = _PREFIX.match(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        agent = self.agents.get(int(match.group(1)))
        if agent is None:
            if scope["type"] == "http":
                await _not_an_agent(scope, len(self.agents))(scope, receive, send)
            return  # a WebSocket to no agent: closed unaccepted
        path = match.group(2) or "/"
        await self.app({**scope, "path": path, "raw_path": path.encode(), SCOPE_KEY: agent},
                       receive, send)


def _not_an_agent(scope: Scope, num_agents: int) -> Any:
    return JSONResponse({"error": {
        "message": f"{scope['path']}: this server answers {num_agents} agents, at /a/1/v1 "
                   f"... /a/{num_agents}/v1", "type": "invalid_request_error", "param": None,
        "code": "not_found"}}, status_code=404)
