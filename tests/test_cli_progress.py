"""The progress bar of long commands: drawn on a terminal (stderr), nothing elsewhere."""

from __future__ import annotations

import io

from rich.console import Console

from kvtrace.cli.progress import step_bar


def test_a_terminal_shows_the_steps_done_of_all():
    out = io.StringIO()
    with step_bar("import long.json", console=Console(file=out, force_terminal=True,
                                                      width=100)) as update:
        assert update is not None
        update(3, 5)
    assert "import long.json" in out.getvalue() and "3/5" in out.getvalue()


def test_no_terminal_no_bar():
    out = io.StringIO()
    with step_bar("import long.json", console=Console(file=out)) as update:
        assert update is None
    assert out.getvalue() == ""
