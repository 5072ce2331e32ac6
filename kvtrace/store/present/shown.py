"""One rule for a recorded value too long to show whole, on every surface that shows it.

A tool result or a prompt can be megabytes; a terminal, a page or a model's
context cannot take them whole. Every surface cuts a text value at
`MAX_SHOWN` characters (`kvtrace show`, the step pages of the report and
the UI, their edit form) and says how many characters it left out and how
to get the whole value: `kvtrace show --full` (or `--json`, which is always
whole), and in the UI a link to the value itself. MCP pages a value by
bytes instead (`offset`, `max_bytes`): a model reads it page by page.
"""

from __future__ import annotations

from typing import Any

MAX_SHOWN = 20_000  # characters of one value shown: about 250 lines of 80 columns


def shown(text: str, *, limit: int = MAX_SHOWN, whole: str | None = None) -> str:
    """`text` up to `limit` characters, then how many were left out and, with `whole`, the
    way to the whole value (`kvtrace show --full RUN@3`, say)."""
    if len(text) <= limit:
        return text
    where = f"; {whole}" if whole else ""
    return f"{text[:limit]}… ({len(text) - limit:,} more characters{where})"


def shown_value(value: Any, *, limit: int = MAX_SHOWN) -> tuple[Any, int]:
    """A JSON value with each string longer than `limit` cut as `shown` cuts it, and how many
    strings were cut (0: the value is whole)."""
    cut = 0

    def walk(item: Any) -> Any:
        nonlocal cut
        if isinstance(item, str) and len(item) > limit:
            cut += 1
            return shown(item, limit=limit)
        if isinstance(item, dict):
            return {key: walk(v) for key, v in item.items()}
        if isinstance(item, list):
            return [walk(v) for v in item]
        return item

    return walk(value), cut
