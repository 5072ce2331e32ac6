"""Pinned linear layers: products of a fixed row count where the GEMM is not row-invariant
(kvtrace/engine/rowblocks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtrace.engine import KVCache, generate, load_engine, prefill
from kvtrace.engine import model as model_module
from kvtrace.engine.packed import can_pack, pack_linears, packed_rows_hold
from kvtrace.engine.rowblocks import (
    ROWS,
    PinnedLinear,
    canonical_products,
    pin_rows,
    pinned_linear,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pinned_product_gives_a_row_the_same_bits_at_any_count_and_offset(dtype):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(1536, 576, generator=generator).to(dtype)
    rows = torch.randn(600, 576, generator=generator).to(dtype)
    reference = pinned_linear(rows, weight)
    assert reference.shape == (600, 1536)
    assert torch.allclose(reference.float(), F.linear(rows, weight).float(), rtol=2e-2, atol=0.5)
    for start, end in [(0, 16), (0, 48), (5, 101), (127, 129), (100, 600), (590, 600), (3, 303)]:
        assert torch.equal(pinned_linear(rows[start:end], weight), reference[start:end])
    batched = pinned_linear(rows[:96].view(2, 48, 576), weight)  # [batch, rows, features] too
    assert torch.equal(batched.reshape(96, 1536), reference[:96])
    assert torch.equal(pinned_linear(rows[7:8], weight), F.linear(rows[7:8], weight))  # one row


def test_prefill_multiplies_in_pinned_products_and_decode_as_it_is(tiny_folder, engine_root,
                                                                  tokens, monkeypatch):
    """The row count of every linear product, seen by a spy on `F.linear`: 128 (or one row,
    the output layer) in prefill's forwards, the plain count in decode steps. (Dense layers:
    test_packed.py counts the packed ones.)"""
    monkeypatch.setattr(model_module, "can_pack", lambda dtype, device: False)
    engine = load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype="bfloat16")
    if engine.pinned_rows is None:
        pin_rows(engine.model)
    layers = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(type(m) is PinnedLinear for m in layers)
    seen: list[int] = []
    real = F.linear

    def spy(x, weight, bias=None):
        seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    prefill(engine, None, tokens(300, seed=6))  # chunks of 300 rows padded to 304
    assert seen and set(seen) == {ROWS, 1}
    seen.clear()
    generate(engine, None, tokens(40, seed=7), max_new_tokens=4, stop_ids=[])
    # The prompt's one forward (48 rows: one product per layer but the output layer's
    # one row), then decode steps of one row each.
    assert seen.count(ROWS) == len(layers) - 1
    assert set(seen) == {ROWS, 1} and len(seen) > len(layers)


def test_the_flag_is_per_thread_and_survives_an_exception():
    import threading

    from kvtrace.engine import rowblocks

    with pytest.raises(ValueError), canonical_products():
        raise ValueError("a forward failed")
    assert rowblocks._state.depth == 0
    inside: list[int] = []
    with canonical_products():
        worker = threading.Thread(target=lambda: inside.append(rowblocks._state.depth))
        worker.start()
        worker.join()
    assert inside == [0]


def test_a_pinned_bfloat16_model_reuses_bit_identically(tiny_folder, engine_root, tokens,
                                                       kv_equal, monkeypatch):
    """Pinned on any machine (as where the GEMM picks kernels by row count), then packed
    where the engine packs (packed.py), hits at odd offsets give cold bits and generation
    matches."""
    monkeypatch.setattr(model_module, "can_pack", lambda dtype, device: False)
    engine = load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype="bfloat16")
    if engine.pinned_rows is None:
        pin_rows(engine.model)
    if can_pack(engine.dtype, engine.device) and packed_rows_hold(engine.model, 2):
        assert pack_linears(engine.model) > 0  # as the engine packs where the probe holds
    prompt = tokens(400, seed=4)
    cold = prefill(engine, None, prompt)
    tokens_cold = generate(engine, None, prompt, max_new_tokens=6, stop_ids=[]).token_ids
    for offset in (1, 37, ROWS - 1, ROWS + 1, 300):
        cache = KVCache(engine)
        prefill(engine, cache, prompt[:offset] + tokens(30, seed=5))
        hot = prefill(engine, cache, prompt)
        assert hot.num_memory_tokens == offset
        assert torch.equal(hot.logits, cold.logits), offset
        assert kv_equal(hot, cold), offset
        assert generate(engine, cache, prompt, max_new_tokens=6,
                        stop_ids=[]).token_ids == tokens_cold


def test_the_engine_pins_bfloat16_where_rows_are_not_invariant(tiny_folder, tmp_path,
                                                                monkeypatch):
    """As where oneDNN picks kernels by row count (AMX): the check fails, bfloat16 is pinned
    with a fingerprint of its own, float32 (strict mode set too late) only warns, and so
    does bfloat16 where a pinned product does not hold either."""
    from kvtrace.engine import model as model_module

    loads = iter(range(10))

    def load(dtype):  # each in a cache folder of its own: no probe answer remembered
        cache_dir = tmp_path / f"cache-{next(loads)}"
        return load_engine(tiny_folder, cache_dir=cache_dir, dtype=dtype)

    plain = load("bfloat16")
    monkeypatch.setattr(model_module, "rows_are_invariant", lambda model: False)
    pinned = load("bfloat16")
    assert pinned.pinned_rows == ROWS
    assert plain.pinned_rows is not None or plain.fingerprint != pinned.fingerprint
    with pytest.warns(UserWarning, match="other bits depending on how many rows"):
        f32 = load("float32")
    assert f32.pinned_rows is None
    monkeypatch.setattr(model_module, "pinned_rows_hold", lambda model: False)
    with pytest.warns(UserWarning, match="other bits depending on how many rows"):
        assert load("bfloat16").pinned_rows is None
