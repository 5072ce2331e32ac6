"""`kvtrace bench fork --peer` end to end on a tiny model, a second `kvtrace serve` as the peer
(figures and workload, not speed: the llama.cpp figures are in docs/benchmarks.md)."""

from __future__ import annotations

from kvtrace.bench.peer import run_peer_bench


def test_the_peer_bench_replays_a_run_and_its_forks_interleaved_through_both(
        tiny_folder, tiny_engine):
    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve import BackgroundServer, make_server

    peer = make_server(backend=LocalBackend(tiny_engine, KVCache(tiny_engine)))
    with BackgroundServer(peer.app) as running:
        figures = run_peer_bench(running.url, model=str(tiny_folder), calls=4,
                                 fork_steps=(1, 2), trials=1)
    assert figures["requests"] == 3 * 4  # the run and two forks, four calls each
    # Each fork took its first S calls from the run and went live from the edited step S.
    assert figures["forks"] == {"fork-1": {"served": 1, "first_live_step": 2},
                                "fork-2": {"served": 2, "first_live_step": 3}}
    # Both servers were sent the same prompts (the same template: the same tokens).
    assert figures["prompt_tokens"]["kvtrace"] == figures["prompt_tokens"]["peer"] > 3 * 4 * 1500
    # Interleaved forks: a single slot recomputes what a radix tree keeps.
    computed = figures["computed_tokens"]
    assert 0 < computed["radix_tree"] < computed["single_slot"]
    # kvtrace serve, in its own process, computed what a radix tree must (the last token of
    # every prompt is always computed, so up to one more per request).
    reported, = figures["computed_tokens_reported"]["kvtrace"]
    assert computed["radix_tree"] <= reported <= computed["radix_tree"] + figures["requests"]
    assert len(figures["kvtrace_s_trials"]) == len(figures["peer_s_trials"]) == 1
    # The peer's /tokenize (kvtrace serve's own) agreed with kvtrace's ids on every request,
    # and both sides started cold: a new kvtrace server, the peer after an unrelated prompt
    # (it has no reset), each trial's first request reusing nothing.
    assert figures["peer_tokens"] == {"checked": 12, "agree": True}
    # The machine's best for the radix tree's computed tokens, which no server beats.
    assert 0 < figures["bound"]["prefill_bound_s"] < figures["kvtrace_s"]
    assert figures["cold_start"] == {"kvtrace": ["a new server"],
                                     "peer": ["one unrelated prompt"]}
