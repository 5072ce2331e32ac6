"""KV layers that grow in place: fewer allocations, the same bits, no silent sharing."""

from __future__ import annotations

import pytest
import torch

from kvtrace.engine import KVCache, generate, prefill
from kvtrace.engine.kvbuffer import GrowingLayer
from kvtrace.errors import CacheError


def _storage(result) -> int:
    return result.kv.layers[0].keys.untyped_storage().data_ptr()


def test_calls_extending_the_live_sequence_write_into_one_buffer(tiny_engine, tokens, kv_equal):
    sequence = tokens(700, seed=60)
    cache = KVCache(tiny_engine)
    storages = set()
    for end in range(200, 701, 25):  # 21 calls, each 25 tokens longer
        result = prefill(tiny_engine, cache, sequence[:end])
        storages.add(_storage(result))
    cold = prefill(tiny_engine, None, sequence)

    # One buffer until its spare rows run out: far fewer than one per call.
    assert len(storages) <= 3
    assert torch.equal(result.logits, cold.logits)
    assert kv_equal(result, cold)


def test_an_earlier_result_overwritten_by_a_later_prefill_refuses_to_decode(tiny_engine, tokens):
    shared = tokens(100, seed=61)
    cache = KVCache(tiny_engine)
    first = prefill(tiny_engine, cache, shared + tokens(40, seed=62))
    prefill(tiny_engine, cache, shared + tokens(40, seed=63))  # takes the buffer over at 100

    with pytest.raises(CacheError, match="overwritten by a later prefill"):
        tiny_engine.model(input_ids=torch.tensor([[5]]), cache=first.kv, use_cache=True)


def test_an_earlier_result_within_the_reused_rows_stays_usable(tiny_engine, tokens, kv_equal):
    prompt = tokens(90, seed=64)
    cache = KVCache(tiny_engine)
    first = prefill(tiny_engine, cache, prompt)
    second = prefill(tiny_engine, cache, prompt + tokens(30, seed=65))

    # first's 90 rows are below where second wrote: decoding on it copies them out.
    with torch.inference_mode():
        tiny_engine.model(input_ids=torch.tensor([[7]]), cache=first.kv, use_cache=True)
    assert first.kv.layers[0].get_seq_length() == 91
    assert _storage(first) != _storage(second)
    cold = prefill(tiny_engine, None, prompt + tokens(30, seed=65))
    assert kv_equal(second, cold)


def test_deferred_output_computed_by_the_next_prompt_in_the_same_buffer(
    tiny_engine, tokens, kv_equal
):
    prompt = tokens(120, seed=66)
    cache = KVCache(tiny_engine)
    out = generate(tiny_engine, cache, prompt, max_new_tokens=12, stop_ids=[], defer_output=True)
    following = prompt + list(out.token_ids) + tokens(20, seed=67)

    hot = prefill(tiny_engine, cache, following)
    cold = prefill(tiny_engine, None, following)

    assert _storage(hot) == _storage(out.prefill)  # decoding and the next prompt: one buffer
    assert hot.num_deferred_tokens == 12
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


def test_a_layer_grows_by_at_least_an_eighth():
    layer = GrowingLayer()
    rows = torch.zeros(1, 2, 1000, 4)
    layer.update(rows, rows)
    first = layer.keys.untyped_storage().data_ptr()
    for _ in range(100):  # 100 more rows, one at a time: no reallocation
        one = torch.ones(1, 2, 1, 4)
        layer.update(one, one)

    assert layer.keys.untyped_storage().data_ptr() == first
    assert layer.get_seq_length() == 1100
    assert torch.equal(layer.keys[:, :, 1000:], torch.ones(1, 2, 100, 4))
    layer.crop(-60)
    assert layer.get_seq_length() == 1040 and layer.keys.shape[2] == 1040
