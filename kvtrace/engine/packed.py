"""bfloat16 linear layers whose weights oneDNN lays out once, at load: F.linear's bits, faster.

Why this exists: on a CPU, torch sends a bfloat16 `F.linear` to oneDNN, which
first reorders the weight into its own blocked layout, at every call. For the
few rows of a decode step that reorder is most of the product: on a 2-core AMD
EPYC with AVX-512 BF16 (2026-12-07, torch 2.13), the default model's layer
products at 4 rows read their weights at 11.9 GB/s as `F.linear` and at 20.3
GB/s with the weights laid out beforehand, and `kvtrace bench decode`'s step
at a 2,400-token prompt fell from 50 to 40 ms (docs/benchmarks.md). At a
prefill's 144 rows the product is ~5 % faster, at 512 the same.

How: `pack_linears` turns each plain linear layer (`torch.nn.Linear`, or
rowblocks.py's `PinnedLinear`) into a `PackedLinear`. Its weight becomes
oneDNN's blocked copy (`torch.ops.mkldnn._reorder_linear_weight`, the op
torch's own compiler packs bfloat16 linear layers with when it freezes a
model), the dense one is freed, and its forward is the product on that layout
(`torch.ops.mkldnn._linear_pointwise`). That is oneDNN's inner-product
primitive where `F.linear` runs its matmul primitive; on this project's
machines the two give the same bits, and the engine packs only where
`packed_rows_hold` sees that: for each distinct shape, at every decode width
up to 16 and the prefill row counts numerics.py checks, on every thread
count the engine may use (the output layer at its decode widths and a few
span widths). So the fingerprint, the KV already cached and the other probes
(taken on the dense weights, before packing) all stand. An output layer tied
to the input embeddings gets a packed copy of its own (the embeddings keep
the dense one): vocabulary x hidden x 2 bytes more (56 MB for the default
model, ~300-500 MB for 0.6-1B models with large vocabularies), ~3 ms less of
a ~40 ms decode step. Packed weights are opaque to anything but these
products (no `F.linear`, no `deepcopy`), so only plain models are packed,
after every probe that reads the weights.

Only bfloat16 on the CPU: float32 products go to MKL in its strict mode
(numerics.py), whose bits a oneDNN product would not keep.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtrace.engine.heap import trim_heap
from kvtrace.engine.numerics import CHECKED_ROWS, REFERENCE_ROWS, distinct_shapes, random_rows
from kvtrace.engine.rowblocks import (
    ROWS,
    PinnedLinear,
    in_canonical_products,
    pinned_linear,
    plain_linears,
)

# Every width of a decode step of up to 16 sequences, the row counts of prefill's forwards that
# numerics.py checks, a pinned product's, and prefill's largest. The output layer multiplies one
# row in a prefill (its last position), a decode step's width, or a span of logits (16 rows and
# more, a draft's check): its larger counts are only sampled, since it is the costliest shape
# to probe. At thread counts other than the most, fewer counts (`_OTHER_THREADS_ROWS`).
_PROBE_ROWS = tuple(sorted({*range(1, 17), *CHECKED_ROWS, ROWS, REFERENCE_ROWS}))
_OUTPUT_ROWS = (*range(1, 18), 32, 37, 64, ROWS)
_OTHER_THREADS_ROWS = (1, 4, 16, ROWS, REFERENCE_ROWS)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch has oneDNN's packed products for `dtype` on `device`, and this CPU
    runs oneDNN's bfloat16 (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX; elsewhere torch converts
    bfloat16 products the slow way, numerics.py's `native_bfloat16`)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.backends.mkldnn.enabled
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and torch.ops.mkldnn._reorder_linear_weight
                    and torch.ops.mkldnn._linear_pointwise)
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
    """The model's plain linear layers (rowblocks.py's rule) whose weight is bfloat16 (a layer
    a model keeps in float32 stays as it is)."""
    return [m for m in plain_linears(model) if m.weight.dtype == torch.bfloat16]


def packed_rows_hold(model: torch.nn.Module, most_threads: int) -> bool:
    """Whether, for each distinct shape `pack_linears` would pack, the packed product gives
    the bits of `F.linear` on the dense weight at every row count in `_PROBE_ROWS`
    (`_OUTPUT_ROWS` for the output layer) on `most_threads` threads, and at
    `_OTHER_THREADS_ROWS` on each smaller count (threads.py may compute on any); False if
    there is nothing to pack, or where oneDNN refuses to pack."""
    output = getattr(model, "get_output_embeddings", lambda: None)()
    layers = distinct_shapes(packable(model), with_bias=True)
    generator = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for layer in layers:
                weight = packed_weight(layer.weight)
                rows = random_rows(layer.weight, REFERENCE_ROWS, generator)
                for threads in range(most_threads, 0, -1):
                    torch.set_num_threads(threads)
                    counts = _OUTPUT_ROWS if layer is output else _PROBE_ROWS
                    if threads < most_threads:
                        counts = tuple(m for m in _OTHER_THREADS_ROWS if m in counts)
                    for m in counts:
                        if not torch.equal(packed_product(rows[:m], weight, layer.bias),
                                           F.linear(rows[:m], layer.weight, layer.bias)):
                            return False
    except RuntimeError:  # oneDNN cannot pack or multiply these here: the layers stay dense
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
