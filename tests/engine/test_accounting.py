"""What a prefill reuses and computes: exact token counts per tier."""

from __future__ import annotations

import pytest
import torch

from kvtrace.engine import KVCache, prefill
from kvtrace.engine.lastlogits import LAST_LOGITS
from kvtrace.errors import UsageError


def test_shared_prefix_from_memory_computes_exactly_the_rest(tiny_engine, tokens):
    shared = tokens(150, seed=20)
    cache = KVCache(tiny_engine)
    first = prefill(tiny_engine, cache, shared + tokens(60, seed=21))
    second = prefill(tiny_engine, cache, shared + tokens(110, seed=22))

    assert (first.num_cached_tokens, first.num_computed_tokens) == (0, 210)
    assert second.num_memory_tokens == 150
    assert second.num_disk_tokens == 0
    assert second.num_computed_tokens == 260 - 150


def test_shared_prefix_from_disk_only_rounds_down_to_the_block(tiny_engine, tokens, make_cache):
    shared = tokens(150, seed=23)
    prefill(tiny_engine, make_cache(tiny_engine), shared + tokens(60, seed=24))
    second = prefill(tiny_engine, make_cache(tiny_engine), shared + tokens(110, seed=25))

    assert second.num_memory_tokens == 0
    assert second.num_disk_tokens == 128  # 150 rounded down to a multiple of 64
    assert second.num_computed_tokens == 260 - 128


def test_an_exact_repeat_computes_nothing_and_gives_the_same_logits(tiny_engine, tokens):
    prompt = tokens(90, seed=26)
    cache = KVCache(tiny_engine)
    first = prefill(tiny_engine, cache, prompt)
    again = prefill(tiny_engine, cache, prompt)

    assert (again.num_memory_tokens, again.num_computed_tokens) == (90, 0)
    assert torch.equal(again.logits, first.logits)
    assert torch.equal(again.logits, prefill(tiny_engine, None, prompt).logits)


def test_a_repeat_whose_logits_were_let_go_computes_its_last_token(tiny_engine, tokens):
    prompt = tokens(90, seed=26)
    cache = KVCache(tiny_engine)
    first = prefill(tiny_engine, cache, prompt)
    for i in range(LAST_LOGITS):  # each a sequence of its own, sharing the prompt
        prefill(tiny_engine, cache, [*prompt, i + 1])
    again = prefill(tiny_engine, cache, prompt)

    assert again.num_memory_tokens == 89
    assert again.num_computed_tokens == 1
    assert torch.equal(again.logits, first.logits)


def test_a_decode_after_an_exact_repeat_matches_one_after_a_cold_prefill(tiny_engine, tokens):
    from kvtrace.engine import generate

    prompt = tokens(70, seed=30)
    cache = KVCache(tiny_engine)
    cold = generate(tiny_engine, None, prompt, max_new_tokens=8)
    generate(tiny_engine, cache, prompt, max_new_tokens=8)
    warm = generate(tiny_engine, cache, prompt, max_new_tokens=8)

    assert warm.prefill.num_computed_tokens == 0
    assert warm.token_ids == cold.token_ids


def test_a_one_token_generation_of_a_repeat_assembles_no_kv(tiny_engine, tokens):
    """Asked for logits only (`need_kv=False`), an exact repeat copies no KV out of the
    cache; a prompt with anything to compute still gets its KV, and a longer generation
    after the repeat decodes as after a cold prefill."""
    from kvtrace.engine import generate

    prompt = tokens(70, seed=31)
    other = tokens(70, seed=32)
    cache = KVCache(tiny_engine)
    first = generate(tiny_engine, cache, prompt, max_new_tokens=1)
    generate(tiny_engine, cache, other, max_new_tokens=1)  # the live sequence is another's
    again = generate(tiny_engine, cache, prompt, max_new_tokens=1)
    fresh = prefill(tiny_engine, cache, tokens(40, seed=33), need_kv=False)

    assert (again.prefill.num_computed_tokens, again.prefill.kv) == (0, None)
    assert again.token_ids == first.token_ids
    assert fresh.kv is not None and fresh.num_computed_tokens == 40
    longer = generate(tiny_engine, cache, prompt, max_new_tokens=6)
    assert longer.prefill.kv is not None
    assert longer.token_ids == generate(tiny_engine, None, prompt, max_new_tokens=6).token_ids


def test_the_whole_prompt_is_never_reused_from_disk(tiny_engine, tokens, make_cache):
    prompt = tokens(128, seed=27)  # exactly two blocks, both on disk
    prefill(tiny_engine, make_cache(tiny_engine), prompt)
    again = prefill(tiny_engine, make_cache(tiny_engine), prompt)

    assert again.num_disk_tokens == 127
    assert again.num_computed_tokens == 1


def test_a_fed_sequence_is_stored_in_full(tiny_engine, tokens, make_cache):
    prompt, output = tokens(100, seed=28), tokens(28, seed=29)
    cache = make_cache(tiny_engine)
    prefill(tiny_engine, cache, prompt + output)  # replay's rebuild: feed, no generation
    follow = prefill(tiny_engine, cache, prompt + output + [5, 6])

    assert follow.num_memory_tokens == 128
    assert len(list(cache.disk_root.rglob("*.safetensors"))) == 2


def test_a_one_token_prompt_computes_one_token(tiny_engine):
    result = prefill(tiny_engine, KVCache(tiny_engine), [42])
    assert (result.num_tokens, result.num_computed_tokens) == (1, 1)
    assert result.logits.shape == (len(tiny_engine.tokenizer),)


def test_an_empty_prompt_is_a_usage_error(tiny_engine):
    with pytest.raises(UsageError):
        prefill(tiny_engine, None, [])


def test_a_token_outside_the_vocabulary_is_a_usage_error(tiny_engine):
    with pytest.raises(UsageError, match="outside the vocabulary"):
        prefill(tiny_engine, None, [1, 2, tiny_engine.vocab_size])


def test_block_size_must_keep_matmuls_row_invariant(tiny_engine):
    with pytest.raises(UsageError, match="multiple of 16"):
        KVCache(tiny_engine, block_size=24)
