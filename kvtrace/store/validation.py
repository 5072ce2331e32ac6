"""Checks of what enters the store, the same on every backend.

SQLite keeps what PostgreSQL refuses (a NUL character in text, a string
longer than its column, a lone surrogate), and Python raises TypeError or
ValueError deep inside for a wrong argument type. So every value is checked
here, before any database sees it, by the API and by bundle import alike: a
bundle that one backend accepts, the other accepts too, and a caller's
mistake is a UsageError naming the parameter. fsck applies the timestamp
rule to what is already stored.

Rules: text is a `str` without NUL that encodes as UTF-8; a note has
non-blank text and an author of at most MAX_AUTHOR characters; a step kind is
1 to 64 letters, digits and '_'; a timestamp is a real number (not a bool)
between 1970 and the year 9999 (what `datetime` can show); a limit is an int
>= 1 (one beyond MAX_LIMIT means no limit).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.store.objects.encoding import MAX_KIND_LENGTH

MAX_AUTHOR = 200
MAX_TIMESTAMP = 253_402_300_799.0  # 9999-12-31T23:59:59Z
MAX_LIMIT = 2**31 - 1


def check_text(value: Any, what: str) -> str:
    """`value` if it is text every backend stores unchanged, else UsageError."""
    if not isinstance(value, str):
        raise UsageError(f"{what} must be a string, not {type(value).__name__}")
    if "\x00" in value:
        raise UsageError(f"{what} contains a NUL character, which PostgreSQL cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{what} is not valid Unicode (a lone surrogate?): {exc.reason}") from exc
    return value


def check_note(text: Any, author: Any) -> None:
    """A note's text (not blank) and author (None, or at most MAX_AUTHOR characters)."""
    if not check_text(text, "a note's text").strip():
        raise UsageError("a note needs some text")
    if author is not None and len(check_text(author, "a note's author")) > MAX_AUTHOR:
        raise UsageError(f"a note's author is a name of at most {MAX_AUTHOR} characters")


def check_kind(kind: Any) -> str:
    """A step kind: 1 to 64 letters, digits and '_'."""
    if (
        not isinstance(kind, str)
        or not 0 < len(kind) <= MAX_KIND_LENGTH
        or not kind.replace("_", "").isalnum()
    ):
        raise UsageError(f"bad step kind {kind!r}: use 1 to {MAX_KIND_LENGTH} letters, digits, '_'")
    return kind


def check_record(payload: Any, meta: Any, raw: Any) -> None:
    """The argument types of `Run.record`: mappings with string keys, raw values as bytes."""
    for name, value in (("payload", payload), ("meta", meta), ("raw", raw)):
        if value is None and name != "payload":
            continue
        if not isinstance(value, Mapping):
            raise UsageError(f"{name} must be a dict of fields, not {type(value).__name__}")
        for key in value:
            check_text(key, f"a {name} field name")
    for key, value in (raw or {}).items():
        if not isinstance(value, (bytes, bytearray)):
            raise UsageError(f"raw field {key!r} must be bytes, not {type(value).__name__}")


def timestamp_problem(value: Any) -> str | None:
    """Why `value` is not a sane timestamp (UNIX seconds), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    if not math.isfinite(value) or not 0 <= value <= MAX_TIMESTAMP:
        return f"{value!r} is not a time between 1970 and 9999"
    return None


def check_timestamp(value: Any, what: str) -> float:
    """`value` as a float if it is a sane timestamp, else UsageError."""
    problem = timestamp_problem(value)
    if problem:
        raise UsageError(f"{what}: {problem}")
    return float(value)


def check_limit(limit: Any) -> int | None:
    """A `limit` argument: None, or an int >= 1 (huge values mean no limit)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise UsageError(f"limit must be an int, not {type(limit).__name__}")
    if limit < 1:
        raise UsageError(f"limit must be at least 1, not {limit}")
    return None if limit > MAX_LIMIT else limit
