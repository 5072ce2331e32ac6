"""`kvtrace bench replay --shape agent` end to end on a tiny model (figures, not speed)."""

from __future__ import annotations

from kvtrace.bench.replay import run_replay_bench


def test_agent_bench_reports_every_figure_and_hits_the_oracle(tiny_folder, tmp_path):
    figures = run_replay_bench(cache_dir=tmp_path, model=str(tiny_folder), shape="agent",
                               calls=3, trials=1)
    assert figures["steps"] == 3 and figures["tool_steps"] == 3
    assert figures["max_prompt_tokens"] > 1500
    assert figures["hit_rate_equals_oracle"] is True and figures["hit_rate"] > 0.5
    assert figures["verify_matching_steps"] == figures["verify_decode_matching_steps"] == 3
    # The resident model is measured before the rebuild, and both RSS bounds are stated.
    assert figures["rss_before_rebuild_mb"] > figures["weights_mb"] > 0
    assert figures["peak_rss_mb"] >= figures["rss_before_rebuild_mb"]
    assert figures["weights_mb"] < figures["resident_rss_mb"]
    runtime = figures["resident_rss_mb"] - figures["weights_mb"]
    assert abs(figures["runtime_after_load_mb"] - runtime) < 0.2  # terms rounded to 0.1 MB
    assert figures["rss_bound_over_resident_mb"] > figures["resident_rss_mb"]
    assert isinstance(figures["peak_rss_within_bound_over_resident"], bool)
    # The formula counts the tier's budget (2 GiB by default), the tighter one its peak.
    assert figures["memory_tier_budget_mb"] == 2048.0
    assert 0 < figures["memory_tier_peak_mb"] < figures["memory_tier_budget_mb"]
    assert figures["rss_bound_tier_peak_mb"] < figures["rss_bound_mb"]
    formula = figures["weights_mb"] + 1.5 * figures["kv_longest_mb"] + 2048.0
    assert abs(figures["rss_bound_mb"] - formula) < 0.2  # each term rounded to 0.1 MB
    assert 0 < figures["runtime_rss_mb"] < figures["resident_rss_mb"]
    # One trial: its pair's ratio is the pair median and the bench's own ratio.
    assert figures["rebuild_ratio_to_feed_bound_pairs"] == [
        figures["rebuild_ratio_to_feed_bound_pair_median"]
    ] == [figures["rebuild_ratio_to_feed_bound"]]
    # The machine's bounds beside the figures: the computed tokens at its GEMM rate (which
    # no rebuild beats), a decode step at its bandwidth.
    bound = figures["bound"]
    assert bound["gemm_gflops"] > 0 and bound["bandwidth_gb_s"] > 0
    assert 0 < bound["prefill_bound_s"] < figures["rebuild_s_cached"]
    assert bound["rebuild_over_bound"] > 1 and bound["decode_step_bound_ms"] > 0
    again = run_replay_bench(cache_dir=tmp_path, model=str(tiny_folder), shape="agent",
                             calls=3, trials=1, with_verify=False)
    assert again["recorded_now"] is False and "verify_s_cached" not in again


def test_replay_bench_rebuilds_the_same_run_through_a_peer_cold_on_its_tokens(
        tiny_folder, tiny_engine, tmp_path):
    """--peer: kvtrace serve as the peer (its /tokenize; no cache reset, so one unrelated
    prompt, which leaves its radix tree warm), two trials taking turns with kvtrace's own."""
    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve import BackgroundServer, make_server

    server = make_server(backend=LocalBackend(tiny_engine, KVCache(tiny_engine)))
    with BackgroundServer(server.app) as running:
        figures = run_replay_bench(cache_dir=tmp_path, model=str(tiny_folder), shape="agent",
                                   calls=3, trials=2, with_verify=False, peer=running.url)
    assert figures["peer"] == running.url and len(figures["peer_s_trials"]) == 2
    assert figures["peer_tokens"] == {"checked": 3, "agree": True}
    assert figures["peer_prompt_tokens"] == figures["prompt_tokens"]
    # The first trial started cold; the second found the first's prompts still cached, and
    # says so rather than passing for cold (what the bench did to vLLM before its reset).
    first, second = figures["peer_cold_start"]
    assert first == "one unrelated prompt"
    assert second.startswith("NOT COLD: ") and second.endswith(" (one unrelated prompt)")
    # Cold, the peer (a radix tree too) computed what kvtrace's own rebuild did, within a
    # couple of tokens a prompt (where each draws the line between a prompt's last token
    # and the output it follows); warm, far less.
    computed = figures["prompt_tokens"] - figures["reused_tokens"]
    cold, warm = figures["peer_computed_tokens"]
    assert abs(cold - computed) <= 2 * 3 and warm < computed / 2
    # Only a cold trial is a figure: the first.
    assert figures["peer_s"] == figures["peer_s_trials"][0]
    assert abs(figures["peer_speedup"] - figures["peer_s"] / figures["rebuild_s_cached"]) < 0.05
