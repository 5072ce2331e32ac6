"""Replay through the local engine and its two-tier cache (tiny random model: fast)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtrace.replay import SamplingParams, continue_run, replay
from kvtrace.replay.oracle import common_prefix_length
from kvtrace.replay.recording import record_generation

SYSTEM = ("You are a careful agent. " * 30).strip()
START = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Question: list three prime numbers."},
]
GREEDY = SamplingParams(max_new_tokens=12)


def _record_linear_run(store, engine, factory, name="linear", calls=9):
    """A linear run of `calls` greedy model calls, recorded live by the local engine."""
    backend = factory(engine)
    result = continue_run(store, name, backend, steps=calls, messages=START, params=GREEDY)
    assert len(result.reports) == calls
    return backend


def test_rebuild_hit_rate_equals_the_oracle_bound_on_an_empty_cache(
    store, tiny_engine, local_backend_factory, tmp_path
):
    _record_linear_run(store, tiny_engine, local_backend_factory)
    fresh = local_backend_factory(tiny_engine, kv_dir=tmp_path / "empty")
    report = replay(store, "linear", fresh, mode="rebuild")
    assert len(report.steps) == 9
    assert [s.reused_tokens for s in report.steps] == [s.oracle_tokens for s in report.steps]
    assert report.total.hit_rate == report.total.oracle_hit_rate
    assert report.steps[0].reused_tokens == 0
    assert all(s.reused_tokens > s.prompt_tokens // 2 for s in report.steps[1:])
    assert all(s.computed_tokens == s.prompt_tokens - s.reused_tokens for s in report.steps)


def test_verify_hit_rate_equals_the_oracle_bound_and_every_step_matches(
    store, tiny_engine, local_backend_factory, tmp_path
):
    _record_linear_run(store, tiny_engine, local_backend_factory)
    fresh = local_backend_factory(tiny_engine, kv_dir=tmp_path / "empty")
    report = replay(store, "linear", fresh, mode="verify")
    assert report.is_match is True and report.total.matching_steps == 9
    assert [s.reused_tokens for s in report.steps] == [s.oracle_tokens for s in report.steps]
    # Each recorded response was checked in one pass, without decoding.
    assert [s.draft for s in report.steps] == ["accepted"] * 9


def test_verify_without_drafts_decodes_and_agrees(
    replay_store, tiny_engine, local_backend_factory, tmp_path
):
    _record_linear_run(replay_store, tiny_engine, local_backend_factory, calls=4)
    drafted = replay(replay_store, "linear",
                     local_backend_factory(tiny_engine, kv_dir=tmp_path / "a"), mode="verify")
    decoding = local_backend_factory(tiny_engine, kv_dir=tmp_path / "b")
    decoded = replay(replay_store, "linear", decoding, mode="verify", use_drafts=False)
    assert [s.draft for s in decoded.steps] == [None] * 4
    assert decoded.is_match is True and drafted.is_match is True
    assert [s.reused_tokens for s in decoded.steps] == [s.reused_tokens for s in drafted.steps]
    assert [s.reused_tokens for s in decoded.steps] == [s.oracle_tokens for s in decoded.steps]
    # Decoded outputs are owed to the cache and computed by the next prompt; storing
    # each at once instead reuses the same tokens and generates the same ones.
    backend = local_backend_factory(tiny_engine, kv_dir=tmp_path / "c")
    stored = replay(replay_store, "linear", backend.storing_output(), mode="verify",
                    use_drafts=False)
    assert stored.is_match is True
    assert [s.reused_tokens for s in stored.steps] == [s.reused_tokens for s in decoded.steps]
    # Replay settles what is owed as it ends: both caches hold the same tokens.
    assert decoding.cache.owed() == []
    assert backend.cache.memory.num_tokens == decoding.cache.memory.num_tokens


def test_owing_output_answers_without_storing_it_and_never_counts_it_reused(
    tiny_engine, local_backend_factory, tmp_path
):
    """The server's mode: an answer's output is owed, not stored; a next prompt that holds
    it computes it and says so; the same tokens as storing it, one forward fewer."""
    from kvtrace.replay.backend import CallRequest

    prompt = tiny_engine.chat_tokens(START)
    call = CallRequest(START, prompt, GREEDY)
    figures = {}
    for mode in ("storing_output", "owing_output"):
        backend = getattr(local_backend_factory(tiny_engine, kv_dir=tmp_path / mode), mode)()
        first = backend.generate(call)
        held = backend.cache.memory.num_tokens
        # The next turn holds the answer, then more.
        longer = [*prompt, *first.output_ids, *tiny_engine.encode(" And the next one?")]
        second = backend.generate(CallRequest(START, longer, GREEDY))
        figures[mode] = (first.output_ids, held, second.reused_tokens, second.output_ids,
                         backend.cache.owed())
    stored, owing = figures["storing_output"], figures["owing_output"]
    assert owing[0] == stored[0] and owing[3] == stored[3]  # the same answers
    assert owing[1] == stored[1] - len(stored[0])  # the output was not stored with the answer
    assert stored[2] == len(prompt) + len(stored[0])  # stored: the output reused
    assert owing[2] == len(prompt)  # owed: computed by the next prompt, and counted computed
    assert stored[4] == [] and len(owing[4]) == 1  # only the second answer is still owed


def test_a_replay_in_a_fresh_process_hits_the_disk_tier(
    replay_store, tiny_engine, local_backend_factory, tmp_path
):
    _record_linear_run(replay_store, tiny_engine, local_backend_factory, calls=8)
    kv_dir = tmp_path / "shared-kv"
    replay(replay_store, "linear", local_backend_factory(tiny_engine, kv_dir=kv_dir))
    script = f"""
import json
from kvtrace import open_store
from kvtrace.engine import KVCache, load_engine
from kvtrace.replay import replay
from kvtrace.replay.local import LocalBackend
engine = load_engine({str(tiny_engine.path)!r}, cache_dir={str(tmp_path / "sub-cache")!r})
backend = LocalBackend(engine, KVCache(engine, disk_dir={str(kv_dir)!r}))
report = replay(open_store({replay_store.url!r}), "linear", backend)
print(json.dumps(report.to_dict()["total"]))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    total = json.loads(out.stdout.strip().splitlines()[-1])
    assert total["disk_tokens"] > 0
    # Every prompt was seen before, so only the tail past the last whole block is computed.
    assert total["hit_rate"] > 0.8


def test_replaying_a_fork_computes_only_the_tokens_after_the_edit(
    store, tiny_engine, local_backend_factory, tmp_path
):
    run = store.run("parent")
    messages = list(START)
    for i in range(4):  # a scripted ReAct agent: call, tool, observation, ...
        response = f"Action: calculator\nAction Input: {i}*7"
        run.record_model_call(list(messages), response, model="scripted")
        run.record_tool_call("calculator", f"{i}*7", i * 7)
        messages += [
            {"role": "assistant", "content": response},
            {"role": "user", "content": f"Observation: {i * 7}"},
        ]
    # Fork before the second tool call, record an edited result, then model calls after it.
    fork = store.fork("parent@3", "fork")
    fork.record_tool_call("calculator", "1*7", 1000)
    forked = [*messages[:4], {"role": "user", "content": "Observation: 1000"}]
    fork.record_model_call(forked, "Final Answer: 1000", model="scripted")

    backend = local_backend_factory(tiny_engine, kv_dir=tmp_path / "kv")
    replay(store, "parent", backend, mode="rebuild")
    report = replay(store, "fork", backend, mode="rebuild")
    shared, after_edit = report.steps[:-1], report.steps[-1]
    assert [s.computed_tokens for s in shared] == [1, 1]  # only each prompt's last token
    parent_prompt = tiny_engine.chat_tokens(messages[:6])  # the parent's call after the tool
    fork_prompt = tiny_engine.chat_tokens(forked)
    edit_at = common_prefix_length(fork_prompt, parent_prompt)
    assert 0 < edit_at < len(fork_prompt) - 1
    assert after_edit.reused_tokens == edit_at
    assert after_edit.computed_tokens == len(fork_prompt) - edit_at


def test_verify_reports_the_step_and_token_of_an_altered_output(
    replay_store, tiny_engine, local_backend_factory, tmp_path
):
    _record_linear_run(replay_store, tiny_engine, local_backend_factory, calls=4)
    path = replay_store.path("linear")
    original = path[2]  # the third model call (no tool calls in this run)
    ids = list(original.meta["usage"]["completion_token_ids"])
    position = 3
    altered_ids = [*ids[:position], (ids[position] + 1) % 49000, *ids[position + 1 :]]
    # The store is append-only: record an altered copy of step 3 on a fork.
    fork = replay_store.fork(path[1].id, "altered")
    from kvtrace.replay.backend import CallResult

    stops = set(tiny_engine.eos_token_ids)
    body = altered_ids[:-1] if altered_ids[-1] in stops else altered_ids
    altered = CallResult(
        len(ids), None, None, None, tiny_engine.decode(body), altered_ids, "stop", 0.0, 0.0
    )
    record_generation(fork, original.content["messages"], altered, model="tiny", params=GREEDY)
    report = replay(
        replay_store,
        "altered",
        local_backend_factory(tiny_engine, kv_dir=tmp_path / "verify"),
        mode="verify",
    )
    assert [s.is_match for s in report.steps] == [True, True, False]
    assert [s.draft for s in report.steps] == ["accepted", "accepted", "rejected"]
    assert report.total.first_mismatch == 3
    mismatch = report.steps[2].mismatch
    assert mismatch is not None and mismatch.position == position
    assert (mismatch.expected_id, mismatch.got_id) == (altered_ids[position], ids[position])
    assert mismatch.expected_text != mismatch.got_text


def test_a_rejected_draft_is_reused_by_the_next_prompt_and_counted_by_the_oracle(
    replay_store, tiny_engine, local_backend_factory, tmp_path
):
    """A scripted response the model would not give: verify computes it (as a draft) anyway."""
    run = replay_store.run("scripted")
    answer = "The answer is 42, as the notes say."
    run.record_model_call(list(START), answer, model="scripted")
    after = [*START, {"role": "assistant", "content": answer},
             {"role": "user", "content": "Thanks."}]
    run.record_model_call(after, "You are welcome.", model="scripted")

    report = replay(replay_store, "scripted",
                    local_backend_factory(tiny_engine, kv_dir=tmp_path / "kv"), mode="verify")

    first, second = report.steps
    assert first.draft == "rejected" and first.is_match is False
    answer_ends = len(tiny_engine.chat_tokens([*START, {"role": "assistant", "content": answer}],
                                              add_generation_prompt=False))
    assert second.reused_tokens is not None and second.reused_tokens >= answer_ends - 1
    assert [s.reused_tokens for s in report.steps] == [s.oracle_tokens for s in report.steps]


def test_compare_uncached_replays_again_without_a_cache(
    replay_store, tiny_engine, local_backend_factory, tmp_path
):
    _record_linear_run(replay_store, tiny_engine, local_backend_factory, calls=3)
    report = replay(
        replay_store,
        "linear",
        local_backend_factory(tiny_engine, kv_dir=tmp_path / "kv"),
        compare_uncached=True,
    )
    assert report.uncached is not None and report.speedup is not None
    assert report.uncached.total.reused_tokens == 0
    assert report.uncached.total.computed_tokens == report.total.prompt_tokens
    assert report.to_dict()["total"]["speedup"] == pytest.approx(report.speedup, rel=1e-3)


def test_a_sampled_run_records_its_seed_and_verifies(
    replay_store, tiny_engine, local_backend_factory, tmp_path
):
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=10)  # no seed given
    continue_run(replay_store, "sampled", local_backend_factory(tiny_engine), steps=3,
                 messages=START, params=sampled)
    seeds = [s.meta["params"]["seed"] for s in replay_store.path("sampled")]
    assert all(isinstance(seed, int) for seed in seeds)
    report = replay(replay_store, "sampled", local_backend_factory(
        tiny_engine, kv_dir=tmp_path / "verify"), mode="verify")
    assert report.is_match is True


def test_analyze_names_a_retokenized_output(replay_store, tiny_engine):
    from kvtrace.replay import analyze

    whole = tiny_engine.encode("hello")
    split = tiny_engine.encode("hel") + tiny_engine.encode("lo")
    assert whole != split and tiny_engine.decode(split) == "hello"
    run = replay_store.run("agent")
    first = list(START)
    generated = [*split, tiny_engine.eos_token_ids[0]]  # what the model "generated"
    run.record_model_call(first, "hello", model="tiny",
                          usage={"completion_token_ids": generated})
    run.record_model_call([*first, {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "Observation: ok"}], "bye", model="tiny")
    result = analyze(replay_store, "agent", tiny_engine)
    assert [b.cause for b in result.breakers] == ["retokenized_output"]
    breaker = result.breakers[0]
    prompt = tiny_engine.chat_tokens(first)
    assert breaker.token_position == len(prompt)  # right where the response begins
    assert breaker.lost_tokens == len(generated)
