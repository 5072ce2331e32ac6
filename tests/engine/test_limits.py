"""The machine's bounds a bench prints beside its figures (kvtrace/bench/limits.py)."""

from __future__ import annotations

import torch

from kvtrace.bench.limits import (
    bandwidth_bytes,
    decode_bound_s,
    gemm_flops,
    linear_weights,
    prefill_flops,
)


def test_prefill_flops_count_the_linear_weights_per_token_and_attention_per_key(tiny_engine):
    config = tiny_engine.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_key = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim
    weights, head = linear_weights(tiny_engine)
    # Every linear weight of the decoder, less the vocabulary projection, which is the head.
    assert head == config.vocab_size * config.hidden_size
    layer_linears = sum(p.numel() for n, p in tiny_engine.model.named_parameters()
                        if n.startswith("model.layers.") and p.dim() == 2)
    assert weights == layer_linears
    # Positions 10, 11, 12 see 11, 12, 13 keys; the head runs once, for the last position.
    assert prefill_flops(tiny_engine, [(10, 13)]) == (2 * weights * 3 + per_key * (11 + 12 + 13)
                                                      + 2 * head)
    # Two spans cost what each costs.
    assert prefill_flops(tiny_engine, [(0, 5), (10, 13)]) == (
        prefill_flops(tiny_engine, [(0, 5)]) + prefill_flops(tiny_engine, [(10, 13)]))


def test_the_machine_rates_are_measured_and_bound_a_decode_step(tiny_engine):
    rate = gemm_flops(torch.float32, rows=64, inner=64, cols=64)
    bandwidth = bandwidth_bytes(16 * 1024 * 1024)
    assert 1e6 < rate < 1e15 and 1e6 < bandwidth < 1e13
    weights = sum(p.numel() * p.element_size() for p in tiny_engine.model.parameters())
    assert decode_bound_s(tiny_engine, bandwidth) == weights / bandwidth
