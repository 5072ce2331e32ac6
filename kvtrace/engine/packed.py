"""bfloat16 linear layers whose weights oneDNN lays out once, at load: F.linear's bits, faster.

Why this exists: on a CPU, torch sends a bfloat16 `F.linear` to oneDNN, which
first reorders the weight into its own blocked layout, at every call. For the
few rows of a decode step that reorder is most of the product: on a 2-core AMD
EPYC with AVX-512 BF16 (2026-12-07, torch 2.13), the default model's layer
products at 4 rows read their weights at 11.9 GB/s as `F.linear` and at 20.3
GB/s with the weights laid out beforehand, and a decode step at a 2,400-token
prompt fell from 48 to 31 ms (docs/benchmarks.md). At a prefill's 144 rows the
product is ~5 % faster, at 512 the same.

How: `pack_linears` turns each plain linear layer (`torch.nn.Linear`, or
rowblocks.py's `PinnedLinear`) into a `PackedLinear`. Its weight becomes
oneDNN's blocked copy (`torch.ops.mkldnn._reorder_linear_weight`, the op
torch's own compiler packs bfloat16 linear layers with when it freezes a
model), the dense one is freed, and its forward is the product on that layout
(`torch.ops.mkldnn._linear_pointwise`): the same kernel `F.linear` runs, minus
the reorder. So the bits are `F.linear`'s. An output layer tied to the input
embeddings gets a packed copy of its own (the embeddings keep the dense one):
56 MB more for the default model, ~3 ms less of a ~35 ms decode step. The engine packs only where
`packed_rows_hold` has seen that on this machine, for each distinct shape, at
every row count a forward may have and every thread count the engine may use;
the fingerprint, the KV already cached and the other probes (taken on the
dense weights, before packing) all stand.

Only bfloat16 on the CPU: float32 products go to MKL in its strict mode
(numerics.py), whose bits a oneDNN product would not keep.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvtrace.engine.heap import trim_heap
from kvtrace.engine.numerics import REFERENCE_ROWS, distinct_shapes, random_rows
from kvtrace.engine.rowblocks import PinnedLinear, in_canonical_products, pinned_linear

# Every width of a decode step of up to 16 sequences, and row counts of prefill's forwards up
# to its largest. The output layer multiplies one row in a prefill (its last position) and a
# decode step's width: its larger counts are only sampled (it is the costliest shape to probe:
# 0.3 s of the default model's 0.4, once per machine, memo.py).
_PROBE_ROWS = (*range(1, 17), 32, 64, 128, 336, REFERENCE_ROWS)
_OUTPUT_ROWS = (*range(1, 17), 32, 64)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch has oneDNN's packed products for `dtype` on `device`."""
    if dtype != torch.bfloat16 or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._reorder_linear_weight and torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):  # an op this build does not have
        return False


def packed_product(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, dense, bias)` for a weight packed by `packed_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (`[out, in]`, bfloat16, dense) in oneDNN's layout for `packed_product`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


class PackedLinear(torch.nn.Linear):
    """A linear layer whose weight is oneDNN's packed copy (module docstring); `pinned`: it was
    a `PinnedLinear`, whose prefill products keep `ROWS` rows each (rowblocks.py)."""

    pinned = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.pinned and in_canonical_products():
            return pinned_linear(input, self.weight, self.bias, product=packed_product)
        return packed_product(input, self.weight, self.bias)


def packable(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's plain linear layers (not subclasses, whose forward may differ)."""
    return [m for m in model.modules()
            if isinstance(m, torch.nn.Linear) and type(m) in (torch.nn.Linear, PinnedLinear)]


def packed_rows_hold(model: torch.nn.Module, thread_counts: Sequence[int]) -> bool:
    """Whether, for each distinct shape `pack_linears` would pack, the packed product gives
    every row count in `_PROBE_ROWS` the bits of `F.linear` on the dense weight, on each of
    `thread_counts` (`_OUTPUT_ROWS` for the output layer); False if there is nothing to
    pack."""
    output = getattr(model, "get_output_embeddings", lambda: None)()
    layers = distinct_shapes(packable(model), with_bias=True)
    generator = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for layer in layers:
                weight = packed_weight(layer.weight)
                rows = random_rows(layer.weight, REFERENCE_ROWS, generator)
                for threads in thread_counts:
                    torch.set_num_threads(threads)
                    for m in _OUTPUT_ROWS if layer is output else _PROBE_ROWS:
                        if not torch.equal(packed_product(rows[:m], weight, layer.bias),
                                           F.linear(rows[:m], layer.weight, layer.bias)):
                            return False
    finally:
        torch.set_num_threads(before)
    return bool(layers)


def pack_linears(model: torch.nn.Module) -> int:
    """Make each of the model's `packable` layers a `PackedLinear`; return how many."""
    layers = packable(model)
    with torch.inference_mode():
        for module in layers:
            pinned = type(module) is PinnedLinear
            module.weight = torch.nn.Parameter(packed_weight(module.weight), requires_grad=False)
            module.__class__ = PackedLinear
            module.pinned = pinned  # type: ignore[assignment]  # an instance's own flag
    # The dense weights freed above lie in the heap's arenas, which glibc keeps resident until
    # trimmed: without this, a packed default model's process held ~200 MB more.
    trim_heap()
    return len(layers)
