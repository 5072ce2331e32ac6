"""A cache hit gives the same bits as a cold computation (the fidelity contract)."""

from __future__ import annotations

import pytest
import torch

from kvtrace.engine import KVCache, generate, prefill

UNALIGNED_OFFSETS = [1, 5, 37, 63, 64, 65, 100, 129, 191, 200, 255, 257, 298]


@pytest.mark.parametrize("offset", UNALIGNED_OFFSETS)
def test_memory_hit_at_any_offset_is_bit_identical_to_cold(tiny_engine, tokens, kv_equal, offset):
    prompt = tokens(300, seed=1)
    cache = KVCache(tiny_engine)  # memory only
    # A sequence sharing exactly `offset` tokens with the prompt.
    prefill(tiny_engine, cache, prompt[:offset] + tokens(40, seed=2))

    hot = prefill(tiny_engine, cache, prompt)
    cold = prefill(tiny_engine, None, prompt)

    assert hot.num_memory_tokens == offset
    assert hot.num_computed_tokens == len(prompt) - offset
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


@pytest.mark.parametrize("offset", [511, 700, 1023, 1025, 1090])
def test_memory_hit_deep_in_a_long_prompt_is_bit_identical_to_cold(
    tiny_engine, tokens, kv_equal, offset
):
    """Offsets where the number of key tiles (64 tokens each) crosses 8 and 16."""
    prompt = tokens(1100, seed=11)
    cache = KVCache(tiny_engine)
    prefill(tiny_engine, cache, prompt[:offset] + tokens(20, seed=12))

    hot = prefill(tiny_engine, cache, prompt)
    cold = prefill(tiny_engine, None, prompt)

    assert hot.num_memory_tokens == offset
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


def test_disk_hit_is_bit_identical_to_cold(tiny_engine, tokens, make_cache, kv_equal):
    prompt = tokens(300, seed=3)
    prefill(tiny_engine, make_cache(tiny_engine), prompt[:200] + tokens(30, seed=4))

    hot = prefill(tiny_engine, make_cache(tiny_engine), prompt)  # new cache: memory empty
    cold = prefill(tiny_engine, None, prompt)

    assert (hot.num_memory_tokens, hot.num_disk_tokens) == (0, 192)
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


def test_memory_then_disk_hit_is_bit_identical_to_cold(tiny_engine, tokens, make_cache, kv_equal):
    prompt = tokens(400, seed=5)
    prefill(tiny_engine, make_cache(tiny_engine), [*prompt[:300], 7])  # disk: 4 blocks
    cache = make_cache(tiny_engine)
    prefill(tiny_engine, cache, [*prompt[:90], 8])  # memory: 90 tokens (+ disk reads)
    cache.clear_memory()
    prefill(tiny_engine, cache, [*prompt[:90], 9])  # memory now holds 0..90 via blocks 0-1

    hot = prefill(tiny_engine, cache, prompt)
    cold = prefill(tiny_engine, None, prompt)

    assert hot.num_memory_tokens >= 90 and hot.num_cached_tokens == 256
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


def test_greedy_tokens_with_hits_equal_cold(tiny_engine, tokens, make_cache):
    prompt = tokens(150, seed=6)
    cold = generate(tiny_engine, None, prompt, max_new_tokens=12, stop_ids=[])
    cache = make_cache(tiny_engine)
    prefill(tiny_engine, cache, [*prompt[:77], 1])
    from_memory = generate(tiny_engine, cache, prompt, max_new_tokens=12, stop_ids=[])
    from_disk = generate(
        tiny_engine, make_cache(tiny_engine), prompt, max_new_tokens=12, stop_ids=[]
    )

    assert from_memory.prefill.num_memory_tokens == 77
    assert from_disk.prefill.num_disk_tokens == 128
    assert len(cold.token_ids) == 12
    assert from_memory.token_ids == cold.token_ids == from_disk.token_ids


def test_generated_output_is_stored_canonically(tiny_engine, tokens, kv_equal):
    prompt = tokens(100, seed=8)
    cache = KVCache(tiny_engine)
    out = generate(tiny_engine, cache, prompt, max_new_tokens=10, stop_ids=[])
    sequence = prompt + list(out.token_ids) + tokens(5, seed=9)

    hot = prefill(tiny_engine, cache, sequence)
    cold = prefill(tiny_engine, None, sequence)

    assert hot.num_memory_tokens == len(prompt) + 10
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


def test_seeded_sampling_repeats_and_differs_by_seed(tiny_engine, tokens):
    prompt = tokens(50, seed=10)
    runs = [
        generate(tiny_engine, None, prompt, max_new_tokens=16, temperature=1.5, seed=s, stop_ids=[])
        for s in (1, 1, 2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids
    assert runs[0].seed == 1


@pytest.mark.slow
def test_default_model_hits_are_bit_identical_to_cold(default_engine, make_cache):
    engine = default_engine
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 25},
        {"role": "user", "content": "List three prime numbers and explain why they are prime."},
    ]
    prompt = engine.chat_tokens(messages)
    assert len(prompt) > 160
    cold = generate(engine, None, prompt, max_new_tokens=8, stop_ids=[])
    cache = make_cache(engine)
    prefill(engine, cache, prompt[:101] + engine.encode(" something else"))

    from_memory = generate(engine, cache, prompt, max_new_tokens=8, stop_ids=[])
    from_disk = generate(engine, make_cache(engine), prompt, max_new_tokens=8, stop_ids=[])

    assert from_memory.prefill.num_memory_tokens == 101
    # the memory run stored every full block of the prompt on disk
    assert from_disk.prefill.num_disk_tokens == len(prompt) // 64 * 64
    assert torch.equal(from_memory.prefill.logits, cold.prefill.logits)
    assert torch.equal(from_disk.prefill.logits, cold.prefill.logits)
    assert from_memory.token_ids == cold.token_ids == from_disk.token_ids


@pytest.mark.parametrize("offset", [1, 37, 64, 129, 257, 298])
def test_bfloat16_hits_are_bit_identical_to_cold(bf16_engine, tokens, make_cache, kv_equal,
                                                  offset):
    """`--dtype bfloat16` is canonical too: a hit from memory or disk gives a cold run's bits."""
    prompt = tokens(300, seed=14)
    cache = make_cache(bf16_engine)
    prefill(bf16_engine, cache, prompt[:offset] + tokens(30, seed=15))

    hot = prefill(bf16_engine, cache, prompt)
    from_disk = prefill(bf16_engine, make_cache(bf16_engine), prompt)
    cold = prefill(bf16_engine, None, prompt)

    assert hot.num_memory_tokens == offset
    assert from_disk.num_disk_tokens == len(prompt) // 64 * 64  # the hot run stored it all
    assert hot.logits.dtype == torch.float32  # logits are widened; the KV stays bfloat16
    for result in (hot, from_disk):
        assert torch.equal(result.logits, cold.logits)
        assert kv_equal(result, cold)


@pytest.mark.slow
def test_default_model_in_bfloat16_hits_are_bit_identical_to_cold(make_cache):
    from kvtrace.engine import load_engine
    from kvtrace.paths import default_cache_dir

    engine = load_engine(None, cache_dir=default_cache_dir(), dtype="bfloat16")
    prompt = engine.chat_tokens([
        {"role": "system", "content": "You are a terse assistant. " * 25},
        {"role": "user", "content": "List three prime numbers and explain why they are prime."},
    ])
    cold = generate(engine, None, prompt, max_new_tokens=8, stop_ids=[])
    cache = make_cache(engine)
    prefill(engine, cache, prompt[:101] + engine.encode(" something else"))
    hot = generate(engine, cache, prompt, max_new_tokens=8, stop_ids=[])

    assert hot.prefill.num_memory_tokens == 101
    assert torch.equal(hot.prefill.logits, cold.prefill.logits)
    assert hot.token_ids == cold.token_ids


@pytest.mark.parametrize("score_bytes", [1, 300_000, 400_000, 2**40])  # 400k: blocks of 48,
# last 32; 2**40: blocks of QUERY_BLOCK_ROWS
def test_attention_split_into_query_blocks_is_bit_identical(
    tiny_engine, tokens, kv_equal, monkeypatch, score_bytes
):
    """Splitting a forward into query blocks (of 16 rows, a few dozen, or the default bound
    of 256) changes no bit."""
    from kvtrace.engine import attention

    prompt = tokens(700, seed=13)
    monkeypatch.setattr(attention, "QUERY_BLOCK_ROWS", 4096)  # a 512-row chunk: one block
    whole = prefill(tiny_engine, None, prompt, logits_from=600)
    monkeypatch.undo()
    monkeypatch.setattr(attention, "SCORE_BYTES", score_bytes)
    assert attention._query_block(512, 11, 2, 2, 4) < 512  # 512 rows over 700 keys: split
    split = prefill(tiny_engine, None, prompt, logits_from=600)
    assert torch.equal(whole.logits, split.logits)
    assert kv_equal(whole, split)
