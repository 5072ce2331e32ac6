"""Pinned linear layers: products of a fixed row count where the GEMM is not row-invariant
(kvtrace/engine/rowblocks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtrace.engine import KVCache, generate, load_engine, prefill
from kvtrace.engine.rowblocks import (
    ROWS,
    PinnedLinear,
    canonical_products,
    pin_rows,
    pinned_linear,
    pinned_rows_hold,
)
from kvtrace.numerics import rows_are_invariant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pinned_product_gives_a_row_the_same_bits_at_any_count_and_offset(dtype):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(1536, 576, generator=generator).to(dtype)
    rows = torch.randn(600, 576, generator=generator).to(dtype)
    reference = pinned_linear(rows, weight)
    assert reference.shape == (600, 1536)
    assert torch.allclose(reference.float(), F.linear(rows, weight).float(), rtol=2e-2, atol=0.5)
    for start, end in [(0, 16), (0, 48), (5, 101), (127, 129), (100, 600), (590, 600)]:
        assert torch.equal(pinned_linear(rows[start:end], weight), reference[start:end])
    batched = pinned_linear(rows[:96].view(2, 48, 576), weight)  # [batch, rows, features] too
    assert torch.equal(batched.reshape(96, 1536), reference[:96])
    assert torch.equal(pinned_linear(rows[7:8], weight), F.linear(rows[7:8], weight))  # one row


def test_pinned_layers_pin_only_inside_canonical_products(tiny_folder, engine_root):
    engine = load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype="bfloat16")
    model = engine.model
    if engine.pinned_rows is None:
        assert pin_rows(model) > 0
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(type(m) is PinnedLinear for m in layers)
    layer = layers[0]
    x = torch.randn(3, 40, layer.in_features).to(torch.bfloat16)
    with canonical_products():
        assert torch.equal(layer(x), pinned_linear(x, layer.weight, layer.bias))
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # a decode step's


def test_a_pinned_bfloat16_model_reuses_bit_identically(tiny_folder, engine_root, tokens,
                                                       kv_equal):
    """Pinned on any machine (as where the GEMM picks kernels by row count), hits at odd
    offsets give cold bits and generation matches."""
    engine = load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype="bfloat16")
    if engine.pinned_rows is None:
        pin_rows(engine.model)
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


def test_the_engine_pins_exactly_where_rows_are_not_invariant(tiny_folder, engine_root):
    """float32 (MKL's strict mode) is never pinned; bfloat16 is where oneDNN picks kernels
    by row count (AMX), and then its fingerprint differs from float32's and says so."""
    f32 = load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype="float32")
    assert f32.pinned_rows is None
    bf16 = load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype="bfloat16")
    probe = load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype="float32")
    probe.model.to(torch.bfloat16)
    invariant = rows_are_invariant(probe.model)
    assert (bf16.pinned_rows is None) == invariant
    if not invariant:
        assert bf16.pinned_rows == ROWS
        assert pinned_rows_hold(bf16.model)
