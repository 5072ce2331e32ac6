"""How a recorded value is written into the page: escaped, made inert, cut, pretty-printed.

Every recorded value (content, names, notes) goes through `escape`: first
`kvtrace.inert` shows its control, format and bidi characters as escapes,
then `html.escape` quotes it for text and attribute values alike. A value
longer than `MAX_SHOWN` characters is cut by the one rule of every surface
(store/present/shown.py), saying how much was left out and how to get it.
"""

from __future__ import annotations

import datetime
import html
import json
from typing import Any

from kvtrace.inert import inert
from kvtrace.store.present.shown import shown

WHOLE = "kvtrace show --full STEP shows it whole"  # where a cut value's rest is


def escape(value: Any) -> str:
    """Escaped for HTML text and attribute values, with controls and bidi characters visible."""
    return html.escape(inert(str(value)), quote=True)


def pre_block(value: Any) -> str:
    if isinstance(value, bytes):
        text = value.decode("utf-8", errors="replace")
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    return f"<pre>{escape(shown(text, whole=WHOLE))}</pre>"


def parsed_arguments(arguments: Any) -> Any:
    """Tool-call arguments as JSON when they parse (shown pretty-printed), else as sent."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return cut(text, 2_000)


def cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)" if limit > 200 else (
        text[: limit - 1] + "…")


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0%"


def when(timestamp: float) -> str:
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")
