"""Checking an expected response (a draft) in one prefill instead of decoding it."""

from __future__ import annotations

import pytest
import torch

from kvtrace.engine import KVCache, generate, prefill
from kvtrace.errors import UsageError


def test_logits_from_computes_every_later_position(tiny_engine, tokens):
    sequence = tokens(150, seed=21)
    cache = KVCache(tiny_engine)
    prefill(tiny_engine, cache, sequence)  # the whole sequence is cached now

    rows = prefill(tiny_engine, cache, sequence, logits_from=120)

    assert rows.logits.shape == (30, tiny_engine.vocab_size)
    assert rows.num_memory_tokens == 120 and rows.num_computed_tokens == 30
    # Row i predicts token i + 1: its argmax is what greedy decoding would choose.
    cold = prefill(tiny_engine, None, sequence[:131])
    assert torch.argmax(rows.logits[10]) == torch.argmax(cold.logits)


def test_logits_from_outside_the_sequence_is_a_usage_error(tiny_engine, tokens):
    with pytest.raises(UsageError, match="logits_from"):
        prefill(tiny_engine, None, tokens(10, seed=1), logits_from=10)


def test_the_greedy_output_as_draft_is_accepted_without_decoding(tiny_engine, tokens, kv_equal):
    prompt = tokens(130, seed=22)
    plain = generate(tiny_engine, None, prompt, max_new_tokens=12, stop_ids=[])
    cache = KVCache(tiny_engine)

    drafted = generate(tiny_engine, cache, prompt, max_new_tokens=12, stop_ids=[],
                       draft=plain.token_ids)

    assert drafted.draft == "accepted"
    assert drafted.token_ids == plain.token_ids and drafted.finish_reason == "length"
    assert drafted.insert_seconds == 0.0
    assert drafted.prefill.num_computed_tokens == len(prompt) + 12
    # The cache holds prompt + output canonically, as after plain generation.
    following = [*prompt, *plain.token_ids, *tokens(5, seed=23)]
    hot = prefill(tiny_engine, cache, following)
    assert hot.num_memory_tokens == len(prompt) + 12
    assert kv_equal(hot, prefill(tiny_engine, None, following))


def test_a_wrong_draft_is_rejected_and_generation_decodes_as_usual(tiny_engine, tokens):
    prompt = tokens(90, seed=24)
    plain = generate(tiny_engine, None, prompt, max_new_tokens=10, stop_ids=[])
    wrong = list(plain.token_ids)
    wrong[4] = (wrong[4] + 1) % tiny_engine.vocab_size

    drafted = generate(tiny_engine, KVCache(tiny_engine), prompt, max_new_tokens=10,
                       stop_ids=[], draft=wrong)

    assert drafted.draft == "rejected"
    assert drafted.token_ids == plain.token_ids
    # Accounting is the first prefill's: the cache was empty.
    assert drafted.prefill.num_computed_tokens == len(prompt) + 10
    assert drafted.prefill_seconds > drafted.prefill.seconds


def test_a_draft_that_cannot_end_generation_is_not_checked(tiny_engine, tokens):
    prompt = tokens(70, seed=25)
    plain = generate(tiny_engine, None, prompt, max_new_tokens=10, stop_ids=[])

    short = generate(tiny_engine, None, prompt, max_new_tokens=10, stop_ids=[],
                     draft=plain.token_ids[:6])

    assert short.draft is None and short.token_ids == plain.token_ids


def test_a_seeded_sample_as_draft_is_accepted_only_with_its_seed(tiny_engine, tokens):
    prompt = tokens(60, seed=26)
    sampled = generate(tiny_engine, None, prompt, max_new_tokens=12, temperature=1.2,
                       seed=5, stop_ids=[])

    same = generate(tiny_engine, None, prompt, max_new_tokens=12, temperature=1.2, seed=5,
                    stop_ids=[], draft=sampled.token_ids)
    other = generate(tiny_engine, None, prompt, max_new_tokens=12, temperature=1.2, seed=6,
                     stop_ids=[], draft=sampled.token_ids)

    assert same.draft == "accepted" and same.token_ids == sampled.token_ids
    assert other.draft == "rejected"
    assert other.token_ids == generate(tiny_engine, None, prompt, max_new_tokens=12,
                                       temperature=1.2, seed=6, stop_ids=[]).token_ids
