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
import typing
from collections.abc import Callable
from typing import Any

from mcp.types import CallToolResult, TextContent

from kvtrace.errors import KvtraceError
from kvtrace.inert import inert, inert_json

DescribeError = Callable[[KvtraceError, str], str]


def library_message(exc: KvtraceError, tool: str) -> str:
    """The error's own message, naming the parameter as the API (and the tool) calls it."""
    return str(exc)


def as_tool(method: Callable[..., dict[str, Any]],
            describe_error: DescribeError) -> Callable[..., CallToolResult]:
    """`method` as a tool function: its parameters, a `CallToolResult` (module docstring)."""
    name = method.__name__

    def call(**arguments: Any) -> CallToolResult:
        try:
            value = method(**arguments)
        except KvtraceError as exc:
            return failed(describe_error(exc, name))
        return succeeded(value)

    # The SDK reads the parameters' schema from the signature: the method's, with its
    # annotations resolved (they are strings under `from __future__ import annotations`).
    hints = typing.get_type_hints(method, include_extras=True)
    parameters = [parameter.replace(annotation=hints[parameter.name])
                  for parameter in inspect.signature(method).parameters.values()]
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        parameters, return_annotation=CallToolResult)
    call.__name__ = name
    call.__doc__ = method.__doc__
    return call


def succeeded(value: dict[str, Any]) -> CallToolResult:
    """A tool's JSON object, structured and as text."""
    text = inert_json(json.dumps(value, ensure_ascii=False, indent=1))
    return CallToolResult(content=[TextContent(type="text", text=text)],
                          structured_content=value)


def failed(message: str) -> CallToolResult:
    """A tool error: one line, recorded characters that could drive a display escaped."""
    line = inert(message, keep_newlines=False)  # as the CLI prints its error line
    return CallToolResult(content=[TextContent(type="text", text=line)], is_error=True)
