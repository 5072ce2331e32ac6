"""Run names and step addresses.

Run names follow Git's ref-name rules, so any name valid here is valid as a
branch name in Git and vice versa (for the rules that matter to us): not empty,
at most 200 characters, no ``..``, no whitespace or control characters, none of
``~ ^ : @ ? * [ \\``, not starting with ``-`` or ``/``, not ending with ``/``,
``.`` or ``.lock``, no ``//`` and no component starting with ``.``. Two more
rules keep names from deceiving a reader: no Unicode format characters
(category Cf: zero-width spaces, byte-order marks, bidi controls such as
U+202E), and names are normalized to NFC, so a composed and a decomposed
``café`` are one run.

A step address (a *spec*) is one of:
``RUN`` (its head), ``RUN@N`` (the N-th step from the root, 1-based),
``RUN~K`` (K steps back from the head), or a unique step-id prefix of at least
7 hex characters. A name is tried as a run before it is tried as an id prefix,
as Git does.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtrace.errors import InvalidNameError, InvalidSpecError

MAX_NAME_LENGTH = 200
MIN_PREFIX_LENGTH = 7
_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:@?*\[\\]")
_HEX = re.compile(r"^[0-9a-f]+$")
_DIGITS = re.compile(r"^[0-9]+$")
_MAX_DIGITS = 18  # a position below 10**18 fits every database's 64-bit integer


def _position(digits: str, text: str) -> int:
    """The N of RUN@N or the K of RUN~K; more than 18 digits exceeds any run."""
    if len(digits.lstrip("0")) > _MAX_DIGITS:
        raise InvalidSpecError(f"bad step address {text[:40]!r}...: the number is too large")
    return int(digits)


def validate_run_name(name: str) -> str:
    """`name` in NFC if it is a valid run name, else raise InvalidNameError."""
    name = normalize_run_name(name)
    problem = _name_problem(name)
    if problem:
        raise InvalidNameError(f"invalid run name {name!r}: {problem}")
    return name


def normalize_run_name(name: Any) -> str:
    """`name` in NFC, the one spelling under which a run is stored and looked up."""
    if not isinstance(name, str):
        raise InvalidNameError(f"a run name must be a string, not {type(name).__name__}")
    return unicodedata.normalize("NFC", name)


def numbered_names(base: str, n: int, is_taken: Callable[[str], bool]) -> list[str]:
    """`base-1`, `base-2`, ...: the first `n` such names `is_taken` refuses (a fork per branch
    or agent: numbers already taken are skipped; `Store.has_run` asks one index row each)."""
    names: list[str] = []
    number = 1
    while len(names) < n:
        name = validate_run_name(f"{base}-{number}")
        if not is_taken(name):
            names.append(name)
        number += 1
    return names


def _name_problem(name: str) -> str | None:
    if not name:
        return "it is empty"
    if any(unicodedata.category(char) in ("Cf", "Cs") for char in name):
        return "it contains an invisible format character (zero-width, bidi control, surrogate)"
    if len(name) > MAX_NAME_LENGTH:
        return f"it is longer than {MAX_NAME_LENGTH} characters"
    match = _FORBIDDEN.search(name) or re.search(r"\s", name)
    if match:
        return f"it contains {match.group()!r} (no spaces, control characters or ~ ^ : @ ? * [ \\)"
    if ".." in name:
        return "it contains '..'"
    if "//" in name:
        return "it contains '//'"
    if name.startswith(("-", "/")) or name.endswith(("/", ".", ".lock")):
        return "it starts with '-' or '/', or ends with '/', '.' or '.lock'"
    if any(part.startswith(".") for part in name.split("/")):
        return "a component starts with '.'"
    return None


@dataclass(frozen=True, slots=True)
class Spec:
    """A parsed step address: a run with a position, or an id prefix."""

    run: str | None = None
    number: int | None = None  # RUN@N: 1-based from the root
    back: int = 0  # RUN~K: steps back from the head
    prefix: str | None = None  # hex id prefix (only when no run by that name exists)


def parse_spec(text: str) -> Spec:
    """Parse a step address; whether a bare word is a run is decided by the store."""
    if not isinstance(text, str):
        raise InvalidSpecError(f"a step address must be a string, not {type(text).__name__}")
    if not text:
        raise InvalidSpecError("empty step address: use RUN, RUN@N, RUN~K or a step-id prefix")
    text = unicodedata.normalize("NFC", text)
    if "@" in text:
        run, _, number = text.rpartition("@")
        if not _DIGITS.match(number) or not number.strip("0"):
            raise InvalidSpecError(f"bad step address {text!r}: in RUN@N, N is a number >= 1")
        return Spec(run=validate_run_name(run), number=_position(number, text))
    if "~" in text:
        run, _, back = text.partition("~")
        back = back or "1"
        if not _DIGITS.match(back):
            raise InvalidSpecError(f"bad step address {text!r}: in RUN~K, K is a number >= 0")
        return Spec(run=validate_run_name(run), back=_position(back, text))
    if _name_problem(text) is None:
        prefix = text if _HEX.match(text) and len(text) >= MIN_PREFIX_LENGTH else None
        return Spec(run=text, prefix=prefix)
    if _HEX.match(text) and len(text) >= MIN_PREFIX_LENGTH:
        return Spec(prefix=text)
    raise InvalidSpecError(
        f"bad step address {text!r}: use RUN, RUN@N, RUN~K or a step-id prefix "
        f"of at least {MIN_PREFIX_LENGTH} hex characters"
    )
