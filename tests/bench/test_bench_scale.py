"""`kvtrace bench scale` end to end at a tiny size on SQLite (figures, not speed)."""

from __future__ import annotations

import json

import pytest

from kvtrace.bench.conversations import agent_document
from kvtrace.bench.scale import SINGLE_RUN, run_scale_bench, steps_of
from kvtrace.cli import main


def test_agent_documents_import_as_the_steps_they_hold(tmp_path):
    from kvtrace import open_store
    from kvtrace.formats import import_document

    with open_store(f"sqlite:///{tmp_path / 's.db'}") as store:
        for shape in ("tau", "swe"):
            document = agent_document(9, seed=4, shape=shape)
            info = import_document(store, document, format="openai", run=shape)
            assert info.depth == steps_of(document) > 9


def test_scale_bench_times_every_operation_at_three_sizes(tiny_model_factory, capsys):
    tokenizer = tiny_model_factory("scale-tokenizer", seed=1)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "scale", "--steps", "2000", "--analyze-steps", "30", "--trials", "1",
              "--model", str(tokenizer), "--json"])
    out, err = capsys.readouterr()
    assert exit_info.value.code in (0, None)
    figures = json.loads(out)
    assert figures["backend"] == "sqlite" and figures["sizes"] == [20, 200, 2000]
    sizes = list(figures["at"].values())
    assert len(sizes) == 3 and sizes[-1]["num_steps"] >= 2000
    assert sizes[0]["num_runs"] < sizes[-1]["num_runs"]
    for size in sizes:
        assert set(SINGLE_RUN) <= set(size["ms"]) and all(v > 0 for v in size["ms"].values())
        # the control store, timed beside it, is the same runs at the smallest size
        assert set(size["control_ms"]) == set(size["ms"]) == set(size["over_control"])
        assert size["import"]["steps_per_s"] > 0 and size["fsck"]["is_ok"] is True
    assert set(SINGLE_RUN) <= set(figures["growth"]) & set(figures["growth_vs_control"])
    assert isinstance(figures["targets_met"], bool)
    assert "timing" in err  # progress goes to stderr, the figures to stdout


def test_scale_bench_refuses_a_store_that_holds_runs(tmp_path):
    from kvtrace import open_store
    from kvtrace.errors import UsageError

    url = f"sqlite:///{tmp_path / 'used.db'}"
    with open_store(url) as store:
        store.run("mine").record_tool_call("t", {}, 1)
    with pytest.raises(UsageError, match="empty store"):
        run_scale_bench(url, num_steps=1000, analyze_steps=0)
