"""The live sequence and free chunking: faster hits, the same bits as a cold prefill."""

from __future__ import annotations

import pytest
import torch

from kvtrace.engine import KVCache, generate, prefill
from kvtrace.engine.cache import LIVE_SEQUENCES
from kvtrace.engine.kvbuffer import growing_layers
from kvtrace.engine.prefilling import MAX_CHUNK_ROWS


def test_a_prompt_extending_the_last_sequence_starts_from_its_live_kv(tiny_engine, tokens):
    first = tokens(150, seed=40)
    cache = KVCache(tiny_engine)
    prefill(tiny_engine, cache, first)

    hit = cache.lookup(first + tokens(20, seed=41))
    cache.release(hit)

    assert hit.num_memory_tokens == 150
    assert hit.live is not None and hit.pieces == ()


def test_live_reuse_is_bit_identical_to_cold(tiny_engine, tokens, kv_equal):
    sequence = tokens(400, seed=42)
    cache = KVCache(tiny_engine)
    for end in (70, 130, 131, 260, 333):  # each call extends the last one, as an agent's do
        prefill(tiny_engine, cache, sequence[:end])

    hot = prefill(tiny_engine, cache, sequence)
    cold = prefill(tiny_engine, None, sequence)

    assert hot.num_memory_tokens == 333
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


def test_a_prompt_on_another_branch_is_assembled_from_the_tree(tiny_engine, tokens, kv_equal):
    shared = tokens(100, seed=43)
    cache = KVCache(tiny_engine)
    prefill(tiny_engine, cache, shared + tokens(50, seed=44))
    for seed in range(LIVE_SEQUENCES):  # the sequence is no longer live
        prefill(tiny_engine, cache, tokens(20, seed=100 + seed))
    prompt = shared + tokens(30, seed=46)

    hit = cache.lookup(prompt)
    cache.release(hit)
    hot = prefill(tiny_engine, cache, prompt)
    cold = prefill(tiny_engine, None, prompt)

    assert hit.live is None and hit.num_memory_tokens == 100
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


def test_a_fork_takes_over_the_live_kv_it_parts_from(tiny_engine, tokens, kv_equal):
    shared = tokens(100, seed=43)
    parted_from = shared + tokens(50, seed=44)
    cache = KVCache(tiny_engine)
    buffers = _buffers(prefill(tiny_engine, cache, parted_from))
    prefill(tiny_engine, cache, tokens(80, seed=45))  # another sequence is the newest
    prompt = shared + tokens(30, seed=46)

    hot = prefill(tiny_engine, cache, prompt)
    again = prefill(tiny_engine, cache, parted_from)  # its rows past the fork were kept

    assert hot.num_memory_tokens == 100 and _same(_buffers(hot), buffers)
    assert kv_equal(hot, prefill(tiny_engine, None, prompt))
    assert again.num_computed_tokens == 0  # an exact repeat (its logits were kept)
    assert kv_equal(again, prefill(tiny_engine, None, parted_from))


def test_runs_taking_turns_each_extend_their_own_live_kv(tiny_engine, tokens, kv_equal):
    """Interleaved runs (forks of one run, agents sharing a server) copy no prefix once
    they have parted."""
    shared = tokens(90, seed=50)
    runs = [shared + tokens(40, seed=51 + i) for i in range(3)]
    cache = KVCache(tiny_engine)
    for run in runs:
        prefill(tiny_engine, cache, run)
    buffers: list[list] = []
    for turn in range(3):
        for i, run in enumerate(runs):
            run += tokens(25, seed=60 + 3 * turn + i)
            hot = prefill(tiny_engine, cache, run)
            cold = prefill(tiny_engine, None, run)

            assert hot.num_memory_tokens == 130 + 25 * turn
            assert torch.equal(hot.logits, cold.logits)
            assert kv_equal(hot, cold)
            if turn == 0:
                buffers.append(_buffers(hot))
            else:  # extended in place, in the run's own buffers
                assert _same(_buffers(hot), buffers[i])


def test_an_exact_repeat_asking_no_kv_leaves_the_live_kv_to_its_run(tiny_engine, tokens):
    """A fork's calls before it parts repeat the run's: counted, not taken over."""
    run = tokens(120, seed=52)
    cache = KVCache(tiny_engine)
    buffers = _buffers(prefill(tiny_engine, cache, run))

    repeat = prefill(tiny_engine, cache, run, need_kv=False)
    onward = prefill(tiny_engine, cache, run + tokens(20, seed=53))

    assert repeat.kv is None and repeat.num_computed_tokens == 0
    assert onward.num_memory_tokens == 120 and _same(_buffers(onward), buffers)


def test_decoding_on_a_prefill_leaves_the_live_kv_canonical(tiny_engine, tokens, kv_equal):
    prompt = tokens(120, seed=47)
    cache = KVCache(tiny_engine)
    out = generate(tiny_engine, cache, prompt, max_new_tokens=9, stop_ids=[], insert_output=False)
    sequence = prompt + list(out.token_ids) + tokens(12, seed=48)

    hot = prefill(tiny_engine, cache, sequence)
    cold = prefill(tiny_engine, None, sequence)

    assert hot.num_memory_tokens == len(prompt)
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


def test_a_tail_longer_than_one_chunk_is_bit_identical_to_cold(tiny_engine, tokens, kv_equal):
    sequence = tokens(MAX_CHUNK_ROWS + 300, seed=49)
    cache = KVCache(tiny_engine)
    prefill(tiny_engine, cache, sequence[:37])

    hot = prefill(tiny_engine, cache, sequence)
    cold = prefill(tiny_engine, None, sequence)

    assert hot.num_computed_tokens == len(sequence) - 37
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


@pytest.mark.parametrize("offset", [1, 40, 99, 100, 101, 120])
def test_a_span_of_logits_is_bit_identical_whatever_the_reuse(tiny_engine, tokens, offset):
    """Draft checks keep every response position's logits; the split must not show."""
    sequence = tokens(130, seed=50)
    cache = KVCache(tiny_engine)
    prefill(tiny_engine, cache, [*sequence[:offset], 3])

    hot = prefill(tiny_engine, cache, sequence, logits_from=100)
    cold = prefill(tiny_engine, None, sequence, logits_from=100)

    assert hot.num_memory_tokens == min(offset, 100)
    assert hot.logits.shape == cold.logits.shape == (30, len(tiny_engine.tokenizer))
    assert torch.equal(hot.logits, cold.logits)


def test_clear_memory_drops_the_live_sequence(tiny_engine, tokens, make_cache):
    first = tokens(150, seed=51)
    cache = make_cache(tiny_engine)
    prefill(tiny_engine, cache, first)
    cache.clear_memory()

    hit = cache.lookup([*first, 5])
    cache.release(hit)

    assert hit.live is None
    assert (hit.num_memory_tokens, hit.num_disk_tokens) == (0, 128)


@pytest.mark.slow
@pytest.mark.parametrize("offset", [1, 9, 64, 117, 250])
def test_default_model_hits_of_any_length_are_bit_identical_to_cold(
    default_engine, tokens, kv_equal, offset
):
    """Tails of 1 to ~650 rows, one forward or two, on the real model's GEMMs."""
    sequence = tokens(MAX_CHUNK_ROWS + 150, seed=52)
    cache = KVCache(default_engine)
    prefill(default_engine, cache, [*sequence[:offset], 7])
    prefill(default_engine, cache, sequence[: offset + 5])  # a tail of 5 rows

    hot = prefill(default_engine, cache, sequence)
    cold = prefill(default_engine, None, sequence)

    assert hot.num_memory_tokens == offset + 5
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


@pytest.mark.slow
def test_default_model_attention_in_query_blocks_is_bit_identical(
    default_engine, tokens, kv_equal, monkeypatch
):
    """The real model's GQA groups (3 query heads per KV head) in blocks of 16 query rows."""
    from kvtrace.engine import attention

    sequence = tokens(400, seed=53)
    whole = prefill(default_engine, None, sequence, logits_from=380)
    monkeypatch.setattr(attention, "SCORE_BYTES", 1)
    split = prefill(default_engine, None, sequence, logits_from=380)
    assert torch.equal(whole.logits, split.logits)
    assert kv_equal(whole, split)


def _buffers(result):
    """The result's per-layer KV buffers, compared by identity (`_same`)."""
    return [layer.buffer for layer in growing_layers(result.kv)]


def _same(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
