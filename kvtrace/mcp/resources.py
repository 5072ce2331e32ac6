"""The MCP resources: runs and steps by address, as JSON documents.

- `kvtrace://runs`: every run (the `list_runs` tool's document);
- `kvtrace://run/{+run}`: one run: its head, length, whether it is paused,
  the cursor of its latest event (for `watch`), and its newest steps in one
  line each (`summary`: text for a person, made inert);
- `kvtrace://step/{+spec}{?pointer,offset,max_bytes}`: one step by any
  address (`job`, `job@3`, `job~1`, an id prefix): the `show_step` tool's
  document, or with `pointer` one page of a value in it (paging.py).

`{+...}` lets a run name keep its slashes (`feat/x@2`). An unknown run or
step is a resource-not-found error, any other bad address or argument an
error; both carry the message `describe_error` gives, made inert.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mcp.server.mcpserver import MCPServer, ResourceSecurity
from mcp.server.mcpserver.exceptions import ResourceError, ResourceNotFoundError

from kvtrace.errors import KvtraceError, NotFoundError, UsageError
from kvtrace.inert import inert, inert_json
from kvtrace.mcp.paging import DEFAULT_MAX_BYTES
from kvtrace.mcp.results import DescribeError
from kvtrace.mcp.tools import Tools
from kvtrace.store.present.summary import step_summary

RUN_STEPS = 20  # steps a run's resource lists, newest first
JSON = "application/json"


def register_resources(server: MCPServer, tools: Tools, describe_error: DescribeError) -> None:
    """Add the resources above to `server`, served by `tools`."""

    def answer(tool: str, make: Callable[[], dict[str, Any]]) -> str:
        try:
            value = make()
        except NotFoundError as exc:
            raise ResourceNotFoundError(_line(describe_error(exc, tool))) from exc
        except KvtraceError as exc:
            raise ResourceError(_line(describe_error(exc, tool))) from exc
        return inert_json(json.dumps(value, ensure_ascii=False))

    @server.resource("kvtrace://runs", name="runs", mime_type=JSON,
                     description="Every run (branch): name, head step id, steps, creation time.")
    def runs() -> str:
        return answer("list_runs", tools.list_runs)

    @server.resource("kvtrace://run/{+run}", name="run", mime_type=JSON,
                     description="One run: head, number of steps, paused or not, the cursor of "
                     f"its latest event (for watch) and its {RUN_STEPS} newest steps in one line "
                     "each.")
    def run(run: str) -> str:
        return answer("log", lambda: run_document(tools, run))

    # A JSON pointer starts with "/": no file path, so the SDK's path checks do not apply.
    @server.resource("kvtrace://step/{+spec}{?pointer,offset,max_bytes}", name="step",
                     mime_type=JSON, security=ResourceSecurity(exempt_params={"pointer"}),
                     description="One step by address (RUN, RUN@N, RUN~K, id prefix): metadata, "
                     "content, notes; fields over max_bytes are listed under `paged`. With "
                     "?pointer=/field (a JSON pointer) and &offset=, one page of that value.")
    def step(spec: str, pointer: str = "", offset: str = "0",
             max_bytes: str = str(DEFAULT_MAX_BYTES)) -> str:
        return answer("show_step", lambda: tools.show_step(
            spec, pointer or None, _number(offset, "offset"), _number(max_bytes, "max_bytes")))


def run_document(tools: Tools, name: str) -> dict[str, Any]:
    """What `kvtrace://run/NAME` shows (module docstring)."""
    store = tools.store
    cursor = store.watch_cursor(name)  # an unknown run fails here
    head = store.head(name)
    steps = list(store.log(name, limit=RUN_STEPS)) if head is not None else []
    return {
        "run": name,
        "head": head.id if head else None,
        "depth": head.depth if head else 0,
        "is_paused": store.is_paused(name),
        "cursor": cursor,
        "steps": [{"depth": s.depth, "id": s.id, "kind": s.kind,
                   "summary": inert(step_summary(s), keep_newlines=False)} for s in steps],
        "remaining_steps": steps[-1].depth - 1 if steps else 0,
    }


def _number(text: str, name: str) -> int:
    """A query parameter that must be a whole number, else UsageError naming it."""
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not a whole number", param=name) from None


def _line(message: str) -> str:
    return inert(message, keep_newlines=False)
