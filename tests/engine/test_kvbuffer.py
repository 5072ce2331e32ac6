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


def test_a_layer_writes_in_place_until_its_spare_rows_run_out():
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


def _borrowed(cache) -> tuple[int, int]:
    """(nodes borrowing their rows, nodes holding a copy) in the memory tree."""
    lent = owned = 0
    stack = list(cache.memory.root.children.values())
    while stack:
        node = stack.pop()
        lent, owned = (lent + 1, owned) if node.loan is not None else (lent, owned + 1)
        stack.extend(node.children.values())
    return lent, owned


def test_an_agent_run_holds_its_kv_once_and_a_branch_copies_it(tiny_engine, tokens, kv_equal):
    sequence = tokens(900, seed=70)
    cache = KVCache(tiny_engine)
    for end in (150, 300, 480, 700):  # the buffers grow past their first capacity on the way
        prefill(tiny_engine, cache, sequence[:end])

    assert _borrowed(cache) == (4, 0)  # every row lives in the live buffers only
    assert cache.memory_stats().num_bytes == 700 * tiny_engine.kv_bytes_per_token

    branch = sequence[:333] + tokens(40, seed=71)  # takes the buffers over at 333
    hot_branch = prefill(tiny_engine, cache, branch)
    lent, owned = _borrowed(cache)
    assert owned >= 1  # rows past 333 were copied into the tree before being overwritten
    assert lent >= 1  # the branch's own rows are borrowed from the buffers it took over

    back = sequence[:700] + tokens(25, seed=72)  # the first line, now from the tree's copies
    hot = prefill(tiny_engine, cache, back)
    assert hot.num_memory_tokens == 700 and hot_branch.num_memory_tokens == 333
    for result, seq in ((hot_branch, branch), (hot, back)):
        cold = prefill(tiny_engine, None, seq)
        assert torch.equal(result.logits, cold.logits)
        assert kv_equal(result, cold)


def test_a_result_cropped_below_the_borrowed_rows_writes_into_a_buffer_of_its_own(
    tiny_engine, tokens, kv_equal
):
    sequence = tokens(200, seed=73)
    cache = KVCache(tiny_engine)
    result = prefill(tiny_engine, cache, sequence)
    result.kv.crop(-50)
    with torch.inference_mode():  # rows 150.. of the result: other tokens than the tree's
        tiny_engine.model(input_ids=torch.tensor([tokens(20, seed=74)]), cache=result.kv,
                          use_cache=True)
    cache.drop_live()  # the tree copies its loans now, from the untouched buffers

    hot = prefill(tiny_engine, cache, sequence + tokens(10, seed=75))
    cold = prefill(tiny_engine, None, sequence + tokens(10, seed=75))
    assert hot.num_memory_tokens == 200
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


def test_decoding_on_a_result_outside_inference_mode(tiny_engine, tokens):
    prompt = tokens(60, seed=76)
    result = prefill(tiny_engine, KVCache(tiny_engine), prompt)
    with torch.no_grad():  # not inference mode: the buffers were made in prefill's
        out = tiny_engine.model(input_ids=torch.tensor([[9]]), cache=result.kv, use_cache=True)
    assert out.logits.shape[1] == 1 and result.kv.layers[0].get_seq_length() == 61


def test_rows_past_a_layers_length_are_zeros_or_its_own_rows(monkeypatch):
    """Prefill attention reads a layer's buffer past its length (attention.py's `flash_attention`):
    whatever memory the buffers are made of, those rows hold zeros, or rows written before a
    crop, never what the allocator left there."""
    real_empty = torch.empty

    def garbage(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", garbage)

    def past_length_is_finite(layer) -> bool:
        buffer = layer.buffer
        return bool(torch.isfinite(buffer.keys).all() and torch.isfinite(buffer.values).all())

    layer = GrowingLayer()
    rows = torch.randn(1, 2, 300, 4)
    layer.update(rows, rows)
    assert past_length_is_finite(layer)
    spare = layer.buffer.keys[:, :, 300:]
    assert torch.equal(spare, torch.zeros_like(spare))
    for _ in range(3):  # past the capacity: the buffer grows
        more = torch.randn(1, 2, 500, 4)
        layer.update(more, more)
        assert past_length_is_finite(layer)
    assert layer.buffer.capacity % 512 == 0  # long: whole flash blocks
    layer.crop(-100)
    layer.detach()
    assert past_length_is_finite(layer)
    seeded = GrowingLayer()
    seeded.seed([(rows, rows), (rows[:, :, :10], rows[:, :, :10])])
    assert past_length_is_finite(seeded) and seeded.buffer.capacity % 64 == 0
