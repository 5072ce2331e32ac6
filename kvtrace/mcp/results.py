"""What a tool call returns: its JSON, or a tool error with the CLI's one-line message.

Each tool is a method that returns a JSON object (the document its CLI twin
prints with `--json`, where it has one) or raises a `KvtraceError`.
`as_tool` turns it into the function the SDK registers, whose result is:

- success: the object as `structuredContent`, exactly as the API gave it
  (recorded strings are data), and the same object as JSON text for
  clients that read text, with control and format characters written as
  JSON escapes (`inert_json`: the text still decodes to the same values);
- a `KvtraceError`: a tool error (`isError`) whose text is one line, the
  message `describe_error` gives (the CLI's `error:` line without its
  prefix, see kvtrace/cli/mcp.py) made inert, as the CLI prints it.
  Nothing was changed: the API is transactional.

Anything else a tool raises is a bug of kvtrace: the SDK logs it and
answers with a tool error that names only the tool.
"""

from __future__ import annotations

import inspect
import json
import logging
import typing
from collections.abc import Callable
from typing import Any

import anyio.from_thread
from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, TextContent

from kvtrace.errors import KvtraceError
from kvtrace.inert import inert, inert_json

DescribeError = Callable[[KvtraceError, str], str]
PROGRESS = "on_progress"
_log = logging.getLogger("kvtrace.mcp")


def library_message(exc: KvtraceError, tool: str) -> str:
    """The error's own message, naming the parameter as the API (and the tool) calls it."""
    return str(exc)


def as_tool(method: Callable[..., dict[str, Any]],
            describe_error: DescribeError) -> Callable[..., CallToolResult]:
    """`method` as a tool function: its parameters, a `CallToolResult` (module docstring).

    A method with an `on_progress(done, total)` parameter gets one that sends the
    client progress notifications (when it asked for them); the parameter is not
    one of the tool's arguments.
    """
    name = method.__name__
    signature = inspect.signature(method)
    wants_progress = PROGRESS in signature.parameters

    def call(context: Context, **arguments: Any) -> CallToolResult:
        if wants_progress:
            arguments[PROGRESS] = _reporter(context)
        try:
            value = method(**arguments)
        except KvtraceError as exc:
            return failed(describe_error(exc, name))
        return succeeded(value)

    # The SDK reads the arguments' schema from the signature: the method's, with its
    # annotations resolved (they are strings under `from __future__ import annotations`),
    # and the request's Context, which it passes (and leaves out of the schema).
    hints = typing.get_type_hints(method, include_extras=True)
    parameters = [parameter.replace(annotation=hints[parameter.name])
                  for parameter in signature.parameters.values() if parameter.name != PROGRESS]
    context = inspect.Parameter("context", inspect.Parameter.KEYWORD_ONLY, annotation=Context)
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*parameters, context], return_annotation=CallToolResult)
    call.__annotations__ = {"context": Context, "return": CallToolResult}
    call.__name__ = name
    call.__doc__ = method.__doc__
    return call


def _reporter(context: Context) -> Callable[[int, int], None]:
    """`on_progress(done, total)` for a tool running on one of the SDK's worker threads."""

    def report(done: int, total: int) -> None:
        try:
            anyio.from_thread.run(context.report_progress, done, total)
        except Exception:  # a client gone or slow never stops the work it asked for
            _log.debug("progress notification not sent", exc_info=True)

    return report


def succeeded(value: dict[str, Any]) -> CallToolResult:
    """A tool's JSON object, structured and as text."""
    text = inert_json(json.dumps(value, ensure_ascii=False))
    return CallToolResult(content=[TextContent(type="text", text=text)],
                          structured_content=value)


def failed(message: str) -> CallToolResult:
    """A tool error: one line, recorded characters that could drive a display escaped."""
    line = inert(message, keep_newlines=False)  # as the CLI prints its error line
    return CallToolResult(content=[TextContent(type="text", text=line)], is_error=True)
