"""bfloat16 linear layers with oneDNN's packed weights: `F.linear`'s bits, the dense weights
gone (kvtrace/engine/packed.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtrace.engine import KVCache, generate, load_engine, packed, prefill
from kvtrace.engine import model as model_module
from kvtrace.engine.packed import (
    PackedLinear,
    can_pack,
    pack_linears,
    packed_product,
    packed_rows_hold,
    packed_weight,
)
from kvtrace.engine.rowblocks import ROWS, pin_rows

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this torch or CPU has no oneDNN bfloat16 products")


@pytest.fixture(scope="module")
def packs(tiny_folder, tmp_path_factory) -> bool:
    """Whether the engine packs the tiny model here (the probe saw F.linear's bits); where it
    rightly declines, the tests of packed bits have nothing to check."""
    engine = load_engine(tiny_folder, cache_dir=tmp_path_factory.mktemp("probe"),
                         dtype="bfloat16")
    return engine.packed_linears > 0


def _needs_packing(packs: bool) -> None:
    if not packs:
        pytest.skip("packed products do not give F.linear's bits on this CPU: nothing packed")


def _dense(folder, cache_dir, monkeypatch):
    """The same model, its linear layers left dense (what the engine loads without packing)."""
    with monkeypatch.context() as patch:
        patch.setattr(model_module, "can_pack", lambda dtype, device: False)
        return load_engine(folder, cache_dir=cache_dir, dtype="bfloat16")


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_product_gives_the_bits_of_f_linear_at_every_row_count(bias, packs):
    _needs_packing(packs)
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(1536, 576, generator=generator).to(torch.bfloat16)
    bias_row = torch.randn(1536, generator=generator).to(torch.bfloat16) if bias else None
    rows = torch.randn(600, 576, generator=generator).to(torch.bfloat16)
    packed_w = packed_weight(weight)
    assert packed_w.is_mkldnn and packed_w.shape == weight.shape
    for m in [*range(1, 20), 48, 100, 128, 300, 512, 600]:
        assert torch.equal(packed_product(rows[:m], packed_w, bias_row),
                           F.linear(rows[:m], weight, bias_row)), m
    batched = rows[:96].view(2, 48, 576)  # [batch, rows, features], and a strided view
    assert torch.equal(packed_product(batched, packed_w, bias_row),
                       F.linear(batched, weight, bias_row))
    strided = rows[:64].t().contiguous().t()
    assert torch.equal(packed_product(strided, packed_w, bias_row),
                       F.linear(strided, weight, bias_row))


def test_a_bfloat16_engine_packs_every_linear_layer_and_keeps_the_dense_bits(
        tiny_folder, tmp_path, tokens, kv_equal, monkeypatch, packs):
    """Prefill's logits and KV, cold and from a hit, and greedy tokens with their logits: the
    same bits packed as dense, and the same fingerprint (the KV cached by one serves the other)."""
    _needs_packing(packs)
    engine = load_engine(tiny_folder, cache_dir=tmp_path / "cache", dtype="bfloat16")
    dense = _dense(tiny_folder, tmp_path / "dense", monkeypatch)
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert engine.packed_linears == len(linears) > 0 and dense.packed_linears == 0
    assert all(type(m) is PackedLinear and m.weight.is_mkldnn for m in linears)
    assert not engine.model.get_input_embeddings().weight.is_mkldnn  # a tied one keeps its own
    assert engine.fingerprint == dense.fingerprint
    prompt = tokens(300, seed=8)
    cold, cold_dense = prefill(engine, None, prompt), prefill(dense, None, prompt)
    assert torch.equal(cold.logits, cold_dense.logits) and kv_equal(cold, cold_dense)
    cache = KVCache(engine)
    prefill(engine, cache, prompt[:77] + tokens(20, seed=9))
    hot = prefill(engine, cache, prompt)
    assert hot.num_memory_tokens == 77
    assert torch.equal(hot.logits, cold_dense.logits) and kv_equal(hot, cold_dense)
    out = generate(engine, None, prompt, max_new_tokens=8, stop_ids=[], padded_decode=True)
    out_dense = generate(dense, None, prompt, max_new_tokens=8, stop_ids=[], padded_decode=True)
    assert out.token_ids == out_dense.token_ids


def test_float32_a_failed_probe_and_a_refusal_leave_the_layers_dense(tiny_folder, tmp_path,
                                                                      monkeypatch):
    f32 = load_engine(tiny_folder, cache_dir=tmp_path / "f32", dtype="float32")
    assert f32.packed_linears == 0
    assert not any(isinstance(m, PackedLinear) for m in f32.model.modules())
    monkeypatch.setattr(model_module, "packed_rows_hold", lambda model, threads: False)
    told = load_engine(tiny_folder, cache_dir=tmp_path / "told", dtype="bfloat16")
    assert told.packed_linears == 0 and "packed_rows" in told.probes.measured
    monkeypatch.undo()

    def refuse(weight):  # as oneDNN where this CPU cannot run its bfloat16 products
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")

    monkeypatch.setattr(packed, "packed_weight", refuse)
    refused = load_engine(tiny_folder, cache_dir=tmp_path / "refused", dtype="bfloat16")
    assert refused.packed_linears == 0 and not refused.model.lm_head.weight.is_mkldnn
    assert prefill(refused, None, list(range(100, 140))).logits.isfinite().all()


def test_the_probe_sees_a_product_that_differs(tiny_folder, tmp_path, monkeypatch, packs):
    """A packed product one bit off at one row count (what another oneDNN kernel could give)
    fails the probe; the engine's real one passes it."""
    dense = _dense(tiny_folder, tmp_path / "dense", monkeypatch)
    assert packed_rows_hold(dense.model, 2) is packs
    real = packed.packed_product

    def off_at_64(x, weight, bias=None):
        out = real(x, weight, bias)
        if x.reshape(-1, x.shape[-1]).shape[0] == 64:
            out = out.clone()
            out.view(-1)[0] = out.view(-1)[0] * 2 + 1
        return out

    monkeypatch.setattr(packed, "packed_product", off_at_64)
    assert not packed_rows_hold(dense.model, 2)


def test_pinned_layers_packed_multiply_prefill_in_pinned_products(
        tiny_folder, tmp_path, tokens, kv_equal, monkeypatch, packs):
    """As on a CPU with AMX, where the engine pins and then packs: prefill's products keep
    `ROWS` rows each (or the output layer's one), decode's their own count, and hits at odd
    offsets give the cold bits of the dense pinned model. Packing frees the dense weights
    (all but the output layer's, which the embeddings share)."""
    import gc
    import weakref

    _needs_packing(packs)
    engine = _dense(tiny_folder, tmp_path / "a", monkeypatch)
    dense = _dense(tiny_folder, tmp_path / "b", monkeypatch)
    for each in (engine, dense):
        pin_rows(each.model)
    head = engine.model.get_output_embeddings()
    weights = [weakref.ref(m.weight) for m in engine.model.modules()
               if isinstance(m, torch.nn.Linear) and m is not head]
    pack_linears(engine.model)
    gc.collect()
    assert weights and all(ref() is None for ref in weights)
    layers = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(type(m) is PackedLinear and m.pinned for m in layers)
    seen: list[int] = []
    real = packed.packed_product

    def spy(x, weight, bias=None):
        seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(packed, "packed_product", spy)
    prompt = tokens(300, seed=6)
    cold = prefill(dense, None, prompt)
    assert set(seen) == set()
    hot_cold = prefill(engine, None, prompt)
    assert seen and set(seen) == {ROWS, 1}
    assert torch.equal(hot_cold.logits, cold.logits) and kv_equal(hot_cold, cold)
    for offset in (1, ROWS + 1):
        cache = KVCache(engine)
        prefill(engine, cache, prompt[:offset] + tokens(30, seed=5))
        hot = prefill(engine, cache, prompt)
        assert hot.num_memory_tokens == offset
        assert torch.equal(hot.logits, cold.logits) and kv_equal(hot, cold), offset
    seen.clear()
    generate(engine, None, tokens(40, seed=7), max_new_tokens=4, stop_ids=[])
    assert set(seen) == {ROWS, 1} and seen.count(1) > len(layers)  # decode: one row each
