"""Recorded text is made inert before a terminal or a page shows it."""

from __future__ import annotations

import unicodedata

import pytest

from kvtrace.inert import inert, is_inert


def test_every_control_and_format_character_is_escaped():
    dangerous = [chr(c) for c in range(0x110000)
                 if unicodedata.category(chr(c)) in ("Cc", "Cf", "Cs") and chr(c) not in "\n\t"]
    assert len(dangerous) > 200
    for char in dangerous:
        shown = inert(f"a{char}b")
        assert shown.startswith("a\\") and shown.endswith("b") and is_inert(shown), hex(ord(char))


@pytest.mark.parametrize(("text", "shown"), [
    ("\x1b]52;c;ZWNobyBoaQ==\x07", "\\x1b]52;c;ZWNobyBoaQ==\\x07"),  # write the clipboard
    ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),  # set the window title
    ("\x1b]8;;http://evil/\x1b\\click\x1b]8;;\x1b\\", "\\x1b]8;;http://evil/\\x1b\\click"
     "\\x1b]8;;\\x1b\\"),  # an OSC 8 hyperlink
    ("rm\u202e\u200bfdp.exe", "rm\\u202e\\u200bfdp.exe"),  # a spoofed tool name
    ("\x9b31m", "\\x9b31m"),  # a C1 control sequence introducer
])
def test_terminal_attacks_are_shown_not_run(text, shown):
    assert inert(text) == shown


def test_printable_text_and_layout_are_left_alone():
    text = "Résumé: 東京 — naïve café 🙂\n\tindented"
    assert inert(text) == text and is_inert(text)
    assert inert(text, keep_newlines=False) == "Résumé: 東京 — naïve café 🙂\\n\\tindented"
