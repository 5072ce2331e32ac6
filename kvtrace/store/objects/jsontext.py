"""JSON text from outside kvtrace (an imported file, a bundle line), parsed within limits.

Python's parser recurses once per level of nesting and converts an integer
of any length to an `int`; so a hostile file ends in a RecursionError, or in
a ValueError from the interpreter's integer-string limit. `loads` turns both
into a UsageError and refuses nesting deeper than the store holds
(`encoding.MAX_DEPTH`), so code after it may walk the value recursively.
Syntax errors are left to the caller, which words them for its kind of file.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.store.objects.encoding import MAX_DEPTH


def loads(
    text: str, source: str, *, parse_constant: Callable[[str], Any] | None = None
) -> Any:
    """The value of `text`; json.JSONDecodeError for bad syntax, UsageError past the limits.

    `source` names the text in the UsageError ("trace.json is nested more
    than 256 levels deep").
    """
    too_deep = f"{source} is nested more than {MAX_DEPTH} levels deep"
    try:
        value = json.loads(text, parse_constant=parse_constant)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # the only other one: an integer past the digit limit
        raise UsageError(
            f"{source} holds a number of more than {sys.get_int_max_str_digits()} digits "
            "(kvtrace stores integers of up to 1,024 bits: write larger ones as strings)"
        ) from exc
    except RecursionError as exc:
        raise UsageError(too_deep) from exc
    if _depth_exceeds(value, MAX_DEPTH):
        raise UsageError(too_deep)
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` deep in `value` (no recursion)."""
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children
                           if isinstance(child, (dict, list)))
    return False
