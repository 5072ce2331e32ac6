"""Recorded text made inert before it reaches a terminal or a page.

Everything in a trace came from outside: a tool result can hold ``ESC ] 52``
(write the user's clipboard), ``ESC ] 0`` (set the window title), OSC 8
hyperlinks or cursor moves, and a tool name can hold U+202E (right-to-left
override) and zero-width characters, so that ``rm\\u202e\\u200bfdp.exe``
displays as something else. `inert` shows every such character as a visible
escape instead of passing it on:

- C0 controls (but newline and tab, which are layout), DEL and C1 controls
  as ``\\xNN``;
- format characters (Unicode category Cf: bidi controls and isolates,
  zero-width spaces and joiners, the BOM, soft hyphen, ...) and lone
  surrogates as ``\\uNNNN``.

Everything else, including every printable non-ASCII letter, is left as it
is. Names of runs are already refused when they hold such characters
(store/names.py); this is for content, which is kept as recorded.
"""

from __future__ import annotations

import re
from functools import lru_cache

# Controls (C0 but \t and \n, DEL, C1), plus the planes where Cf and Cs characters live.
_SUSPECT = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2"
    "\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb"
    "\ud800-\udfff\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]"
)


def inert(text: str, *, keep_newlines: bool = True) -> str:
    """`text` with every control, format and surrogate character shown as an escape.

    With `keep_newlines=False` a newline and a tab are escaped too (one-line output).
    """
    text = _SUSPECT.sub(_escape, text)
    if not keep_newlines:
        text = text.replace("\n", "\\n").replace("\t", "\\t")
    return text


def inert_json(document: str) -> str:
    """A JSON document with the same characters escaped the JSON way (``\\uNNNN``).

    Still valid JSON that decodes to the same values: such characters can
    only occur inside its strings, where a JSON escape means the character
    itself. `json.dumps` escapes C0 controls already, but not C1 controls or
    format characters when it keeps non-ASCII text readable.
    """
    return _SUSPECT.sub(_json_escape, document)


def is_inert(text: str) -> bool:
    """Whether `text` holds nothing `inert` would escape (newlines and tabs allowed)."""
    return _SUSPECT.search(text) is None


def _escape(match: re.Match[str]) -> str:
    return _escaped(match.group())


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    high, low = divmod(code - 0x10000, 0x400)
    return f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04x}"


@lru_cache(maxsize=256)
def _escaped(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"

