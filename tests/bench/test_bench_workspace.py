"""`kvtrace bench workspace` measures what it says, on a small folder (issue 43, item 1)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app, main


def test_the_workspace_bench_reads_only_what_changed_and_counts_the_growth():
    shown = CliRunner().invoke(app, ["bench", "workspace", "--files", "60", "--mb", "0.6",
                                     "--changed", "2", "--rounds", "5", "--json"])
    assert shown.exit_code == 0, shown.output
    figures = json.loads(shown.stdout)
    assert figures["files_read_per_snapshot"] == 2
    assert figures["changed_bytes"] == 5 * 2 * 10_000
    # Random bytes do not compress: the growth is what changed, plus the trees' deltas.
    assert 1.0 <= figures["growth_over_changed"] <= 1.1
    assert figures["snapshot_ms_p50"] > 0 and figures["unchanged_ms_p50"] > 0


def test_the_workspace_bench_refuses_more_rounds_than_files(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "workspace", "--files", "10", "--changed", "3", "--rounds", "5"])
    assert exit_info.value.code == 2 and "at most --files" in capsys.readouterr().err
