"""Recorded content reaches the terminal inert: no escape sequence runs, no bidi spoofing.

Both store backends: the store fixture is a SQLite file or a PostgreSQL schema,
passed to the CLI as --store.
"""

from __future__ import annotations

import json

import pytest

from kvtrace.cli import main

CLIPBOARD = "\x1b]52;c;ZWNobyBwd25lZA==\x07"  # OSC 52: write the clipboard
TITLE = "\x1b]0;pwned\x07"  # OSC 0: set the window title
LINK = "\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\"  # OSC 8 hyperlink
SPOOFED = "rm\u202e\u200bfdp.exe"  # right-to-left override and a zero-width space
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\u200b")


def kv(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out + err


@pytest.fixture
def hostile(store, store_url):
    run = store.run("main")
    run.record_tool_call(SPOOFED, {"path": TITLE}, f"{CLIPBOARD} {LINK} \x9b31m")
    store.fork("main", "other").record_tool_call("calc", {"x": 1}, TITLE)
    store.note("main", f"see {SPOOFED}", author=TITLE)
    return store_url


@pytest.mark.parametrize("argv", [
    ["log", "main"], ["log", "main", "--graph"], ["show", "main"], ["diff", "main", "other"],
    ["runs"],
])
def test_text_output_shows_controls_and_bidi_characters_as_escapes(capsys, hostile, argv):
    code, out = kv(capsys, "--store", hostile, *argv)
    assert code == 0, out
    assert not any(char in out for char in RAW), repr(out)
    if argv[0] in ("log", "show"):
        assert "rm\\u202e\\u200bfdp.exe" in out


@pytest.mark.parametrize("argv", [["log", "main", "--json"], ["show", "main", "--json"]])
def test_json_output_escapes_them_and_still_decodes_to_the_recording(capsys, hostile, argv):
    code, out = kv(capsys, "--store", hostile, *argv)
    assert code == 0 and not any(char in out for char in RAW), repr(out)
    document = json.loads(out)
    step = document[0] if isinstance(document, list) else document
    assert step["meta"]["tool"] == SPOOFED  # the data itself is unchanged


@pytest.mark.parametrize("argv", [
    ["show", f"main{TITLE}"], ["fork", "main", f"ma{SPOOFED}"], ["note", "main", f"x\x00{TITLE}"],
    ["import", f"/nonexistent/run{TITLE}{SPOOFED}.json"],  # quoted as given, not by repr
], ids=["address", "run name", "note text", "file name"])
def test_an_error_line_quoting_the_input_shows_it_as_escapes(capsys, hostile, argv):
    code, out = kv(capsys, "--store", hostile, *argv)
    assert code == 2 and out.startswith("error: ") and out.count("\n") == 1, repr(out)
    assert not any(char in out for char in RAW), repr(out)
