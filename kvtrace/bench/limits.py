"""What the machine can do at best: the bounds a benchmark prints beside its figure.

A figure means more next to what the hardware allows. Two rates, measured
here, on the thread count the engine computes on:

- `gemm_flops(dtype)`: the matrix-product rate, from products of the
  default model's own MLP shape (`[512, 576] x [576, 1536]`, prefill's
  largest forward), the fastest of a few;
- `bandwidth_bytes()`: memory read bandwidth, from summing a 512 MiB tensor
  (far past any cache), the fastest of a few.

and two bounds built on them:

- `prefill_bound_s(engine, spans, rate)`: the tokens a replay computes, as
  (start, end) positions of each prompt's computed part, times the FLOPs
  each costs: 2 x the decoder's linear weights (the embedding is a lookup;
  the vocabulary projection runs for the last position only, added once per
  span) plus attention's 4 x layers x heads x head dim x position (QK^T and
  AV over the keys before it), over the GEMM rate;
- `decode_bound_s(engine, bandwidth)`: one decode step reads every weight
  once (the input embeddings' one row): those bytes over the bandwidth.

Nothing here is a target by itself: the engine issue asks for a prefill
within 1.5x of its bound and a decode step within 1.5x of its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

_REPEATS = 5


def gemm_flops(dtype: Any, *, rows: int = 512, inner: int = 576, cols: int = 1536) -> float:
    """FLOP/s of `[rows, inner] x [inner, cols]` products in `dtype`, the fastest of a few."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=generator).to(dtype)
    b = torch.randn(cols, inner, generator=generator).to(dtype)
    flops = 2.0 * rows * inner * cols
    with torch.inference_mode():
        torch.nn.functional.linear(a, b)  # warm: the kernel's first call sets itself up
        best = float("inf")
        for _ in range(_REPEATS):
            started = time.perf_counter()
            for _ in range(8):
                torch.nn.functional.linear(a, b)
            best = min(best, (time.perf_counter() - started) / 8)
    return flops / best


def bandwidth_bytes(num_bytes: int = 512 * 1024 * 1024) -> float:
    """Bytes/s read by summing a `num_bytes` float32 tensor, the fastest of a few."""
    import torch

    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    with torch.inference_mode():
        data.sum()
        best = float("inf")
        for _ in range(_REPEATS):
            started = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - started)
    return num_bytes / best


def linear_weights(engine: Any) -> tuple[int, int]:
    """(the decoder layers' linear weights, the vocabulary projection's), in parameters."""
    import torch

    head = engine.model.get_output_embeddings()
    layers = sum(m.weight.numel() for m in engine.model.modules()
                 if isinstance(m, torch.nn.Linear) and m is not head)
    return layers, (head.weight.numel() if head is not None else 0)


def prefill_flops(engine: Any, spans: Iterable[tuple[int, int]]) -> float:
    """FLOPs of computing positions [start, end) of each span (module docstring)."""
    config = engine.model.config
    text = getattr(config, "text_config", None) or config
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    layers = int(text.num_hidden_layers)
    weights, head = linear_weights(engine)
    per_position = 4.0 * layers * heads * head_dim
    total = 0.0
    for start, end in spans:
        count = end - start
        # keys attended: position p sees p + 1 keys; summed over p in [start, end)
        keys = (end * (end + 1) - start * (start + 1)) / 2
        total += 2.0 * weights * count + per_position * keys + 2.0 * head
    return total


def prefill_bound_s(engine: Any, spans: Iterable[tuple[int, int]], flops_per_s: float) -> float:
    """The fastest the spans' prefill can be at `flops_per_s`."""
    return prefill_flops(engine, spans) / flops_per_s


def decode_bound_s(engine: Any, bytes_per_s: float) -> float:
    """The fastest one decode step can be: every weight read once at `bytes_per_s`, but the
    input embeddings, of which a step reads a row (unless the output layer multiplies the
    same weight: then once, as that layer's; engine/packed.py gives it a copy of its own)."""
    model = engine.model
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    read = [p for p in model.parameters()
            if p is not embeddings or (head is not None and head.weight is p)]
    return sum(p.numel() * p.element_size() for p in read) / bytes_per_s


def machine_rates(dtype: Any) -> dict[str, float]:
    """The machine's GEMM rate in `dtype` and its read bandwidth, as a bench prints them, on
    every thread the engine may use (whatever the load left it)."""
    from kvtrace.engine.threads import engine_threads

    budget = engine_threads()
    with budget.pinned(budget.most):
        budget.adjust()
        return {"gemm_gflops": round(gemm_flops(dtype) / 1e9, 1),
                "bandwidth_gb_s": round(bandwidth_bytes() / 1e9, 2),
                "threads": budget.most}
