"""Deferred output: a decoded output is stored by the next prefill that contains it."""

from __future__ import annotations

import torch

from kvtrace.engine import KVCache, generate, prefill, settle
from kvtrace.engine.deferred import MAX_DEFERRED


def test_deferred_output_is_computed_by_the_next_prompt_bit_identical_to_cold(
    tiny_engine, tokens, kv_equal
):
    prompt = tokens(100, seed=8)
    cache = KVCache(tiny_engine)
    out = generate(tiny_engine, cache, prompt, max_new_tokens=10, stop_ids=[], defer_output=True)
    assert out.insert_seconds == 0.0
    assert cache.memory.num_tokens == len(prompt)  # the output is owed, not stored yet
    sequence = prompt + list(out.token_ids) + tokens(5, seed=9)

    hot = prefill(tiny_engine, cache, sequence)
    cold = prefill(tiny_engine, None, sequence)

    assert hot.num_memory_tokens == len(prompt)
    assert hot.num_deferred_tokens == 10
    assert hot.num_computed_tokens == 15  # the owed output and the new tokens, in one forward
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)
    assert cache.memory.num_tokens == len(sequence)


def test_deferral_changes_no_generated_token(tiny_engine, tokens):
    prompt = tokens(90, seed=3)
    stored, deferred = KVCache(tiny_engine), KVCache(tiny_engine)
    for turn in range(3):
        a = generate(tiny_engine, stored, prompt, max_new_tokens=6, stop_ids=[])
        b = generate(tiny_engine, deferred, prompt, max_new_tokens=6, stop_ids=[],
                     defer_output=True)
        assert a.token_ids == b.token_ids
        # Stored at once, the output is memory reuse; deferred, it is owed reuse.
        reuse_b = b.prefill.num_memory_tokens + b.prefill.num_deferred_tokens
        assert reuse_b == a.prefill.num_memory_tokens
        prompt = prompt + list(a.token_ids) + tokens(7, seed=20 + turn)


def test_owed_output_counts_only_where_the_prompt_follows_it(tiny_engine, tokens):
    prompt = tokens(80, seed=4)
    cache = KVCache(tiny_engine)
    out = list(generate(tiny_engine, cache, prompt, max_new_tokens=8, stop_ids=[],
                        defer_output=True).token_ids)
    # A prompt that keeps 3 of the 8 output tokens, then differs.
    other = [t + 1 for t in out[3:]]
    hot = prefill(tiny_engine, cache, prompt + out[:3] + other + tokens(4, seed=5))
    assert (hot.num_memory_tokens, hot.num_deferred_tokens) == (len(prompt), 3)
    # The 3 are settled; the other 5 are still owed, after them.
    again = prefill(tiny_engine, cache, prompt + out + tokens(4, seed=6))
    assert (again.num_memory_tokens, again.num_deferred_tokens) == (len(prompt) + 3, 5)
    assert cache.owed() == []


def test_settle_stores_what_is_owed(tiny_engine, tokens, kv_equal):
    prompt = tokens(70, seed=14)
    cache = KVCache(tiny_engine)
    out = list(generate(tiny_engine, cache, prompt, max_new_tokens=7, stop_ids=[],
                        defer_output=True).token_ids)
    assert cache.owed() == [tuple(prompt + out)]
    settle(tiny_engine, cache)
    assert cache.owed() == [] and cache.memory.num_tokens == len(prompt) + 7
    sequence = prompt + out + tokens(3, seed=15)
    hot = prefill(tiny_engine, cache, sequence)
    assert (hot.num_memory_tokens, hot.num_deferred_tokens) == (len(prompt) + 7, 0)
    assert kv_equal(hot, prefill(tiny_engine, None, sequence))


def test_a_prompt_on_another_branch_leaves_the_owed_output(tiny_engine, tokens):
    trunk = tokens(64, seed=1)
    cache = KVCache(tiny_engine)
    first = list(generate(tiny_engine, cache, trunk + tokens(16, seed=2), max_new_tokens=5,
                          stop_ids=[], defer_output=True).token_ids)
    generate(tiny_engine, cache, trunk + tokens(16, seed=3), max_new_tokens=5, stop_ids=[],
             defer_output=True)  # another branch in between
    hot = prefill(tiny_engine, cache, trunk + tokens(16, seed=2) + first + tokens(3, seed=4))
    assert hot.num_deferred_tokens == 5


def test_owed_output_of_a_lost_prompt_is_a_miss(tiny_engine, tokens):
    prompt = tokens(80, seed=4)
    cache = KVCache(tiny_engine)
    out = list(generate(tiny_engine, cache, prompt, max_new_tokens=6, stop_ids=[],
                        defer_output=True).token_ids)
    cache.memory.clear()  # the prompt's KV is gone (as under a full budget), the debt not
    cache.drop_live()
    hot = prefill(tiny_engine, cache, prompt + out + tokens(3, seed=7))
    assert (hot.num_memory_tokens, hot.num_deferred_tokens) == (0, 0)


def test_clear_memory_forgets_owed_output_and_only_the_newest_are_kept(tiny_engine, tokens):
    cache = KVCache(tiny_engine)
    prompt = tokens(40, seed=1)
    out = list(generate(tiny_engine, cache, prompt, max_new_tokens=4, stop_ids=[],
                        defer_output=True).token_ids)
    cache.clear_memory()
    prefill(tiny_engine, cache, prompt)
    assert prefill(tiny_engine, cache, prompt + out + [5, 6]).num_deferred_tokens == 0

    for seed in range(MAX_DEFERRED + 1):
        cache.defer([*prompt, 100 + seed], len(prompt))
    oldest = prefill(tiny_engine, cache, [*prompt, 100, 7])
    newest = prefill(tiny_engine, cache, [*prompt, 100 + MAX_DEFERRED, 7])
    assert (oldest.num_deferred_tokens, newest.num_deferred_tokens) == (0, 1)
