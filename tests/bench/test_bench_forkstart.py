"""`kvtrace bench fork --processes`: whole `kvtrace record` processes on a tiny model."""

from __future__ import annotations


def test_the_process_bench_times_a_rerun_and_a_fork_and_what_the_fork_saved(
        tiny_model_folder, tmp_path, monkeypatch):
    from kvtrace.bench.forkstart import run_fork_start_bench

    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    figures = run_fork_start_bench(model=str(tiny_model_folder), calls=4, k=2, max_tokens=4,
                                   tool_seconds=0.0, trials=1, dtype="float32")
    assert figures["model"] == tiny_model_folder.name
    assert len(figures["full_s_trials"]) == len(figures["from_s_trials"]) == 1
    assert figures["full_s"] > 0 and figures["from_s"] > 0
    assert abs(figures["ratio"] - figures["from_s"] / figures["full_s"]) < 0.002
    # The re-run's first two calls were timed by the agent; the first waited for the load.
    assert 0 < figures["prefix_s"] < figures["full_s"]
    assert figures["first_call_s"] <= figures["prefix_s"]
    # The fork answered its first two calls from the recording and went live at the third.
    assert figures["from"]["num_served"] == 2 and figures["from"]["first_live_step"] == 3
    assert abs(figures["saved_s"] - (figures["full_s"] - figures["from_s"])) < 0.01
