"""Linear layers in products of one fixed row count, where the CPU's GEMM is not row-invariant.

Why this exists: canonical prefill (prefilling.py) needs a matrix product to
give a row the same bits however many rows it multiplies at once
(numerics.py). MKL's strict mode gives that for float32. bfloat16 goes to
oneDNN instead, and on CPUs with AMX (Intel Xeon, Sapphire Rapids and
later) oneDNN chooses its kernel and its blocking by the row count: on a
2-core Xeon with AMX (2026-12-03, torch 2.13), a `[m, 1536] x [1536, 576]`
product gives a few rows other bits for every m from 48 to 512 than for
m = 1024, with one thread or two, and a 96-token extension of a cached
prefix no longer matched its cold run. Capping oneDNN below AMX
(`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`) restores the property and costs
~10x: AMX multiplies these shapes at ~1,900 GFLOPS there, AVX-512 BF16 at
~200.

A product of exactly `ROWS` rows gives a row the same bits wherever it
sits among them (probed at load, `pinned_rows_hold`). So where
`rows_are_invariant` fails for a dtype MKL's strict mode does not cover
(bfloat16; float32's failure means strict mode was not set in time, and
stays a warning), the engine pins its linear layers
(`pin_rows`): inside `canonical_products()`, which prefill's forwards
enter, every linear layer multiplies in products of `ROWS` rows, the last
one padded with zero rows. Decode steps stay outside it and multiply as
they are: their KV is never stored (generation.py), and cached and uncached
runs decode from the same bits. Attention's products (attention.py) have
fixed tile shapes in the key and head dimensions and are not probed here;
the bfloat16 parity tests (tests/engine/test_parity.py) hold them on such a
machine.

A product of one row is a fixed shape too, so it multiplies as it is: the
output layer on a prefill's last position (one row unless a span of
logits is asked for, prefilling.py; the two are never compared bit for bit),
~4 ms a request at 128 rows. The cost is the padding and the
smaller products: a 96-row extension multiplies 128 rows, a 512-row chunk
four products of 128 (docs/benchmarks.md: the default model's
cold prefill ~20 % slower than unpinned in bfloat16, an extension ~12 %).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from kvtrace.engine.numerics import fixed_count_rows_hold

ROWS = 128  # rows per pinned product (module docstring; docs/benchmarks.md)
_PROBE_OFFSETS = (1, 16, 57)


class _State(threading.local):
    """Whether this thread is inside a canonical forward (prefill's, not a decode step's)."""

    def __init__(self) -> None:
        self.depth = 0


_state = _State()


@contextmanager
def canonical_products() -> Iterator[None]:
    """Pinned linear layers multiply in `ROWS`-row products on this thread while inside."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1


def in_canonical_products() -> bool:
    """Whether this thread is inside `canonical_products()` (a prefill's forward)."""
    return _state.depth > 0


class PinnedLinear(torch.nn.Linear):
    """A linear layer that, inside `canonical_products()`, multiplies `ROWS` rows at a time."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not _state.depth:
            return F.linear(input, self.weight, self.bias)
        return pinned_linear(input, self.weight, self.bias)


Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def pinned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  product: Product | None = None) -> torch.Tensor:
    """`product(x, weight, bias)` (`F.linear`'s, or packed.py's for a packed weight) as
    products of exactly `ROWS` rows (zero rows padding the last), or of one row if `x` has
    one."""
    product = product or F.linear  # looked up now, not at import (a test's spy replaces it)
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count <= 1:  # one row is a fixed shape too: prefill's output layer on its last position
        return product(x, weight, bias)
    padded = -(-count // ROWS) * ROWS
    if padded != count:
        rows = F.pad(rows, (0, 0, 0, padded - count))
    parts = [product(rows[i:i + ROWS], weight, bias) for i in range(0, padded, ROWS)]
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out[:count].reshape(*x.shape[:-1], weight.shape[0])


def pin_rows(model: torch.nn.Module) -> int:
    """Make every plain linear layer of `model` a `PinnedLinear`; return how many."""
    layers = plain_linears(model)
    for module in layers:
        module.__class__ = PinnedLinear
    return len(layers)


def pinned_rows_hold(model: torch.nn.Module) -> bool:
    """Whether a `ROWS`-row product gives a row the same bits wherever it sits among them,
    for each distinct linear layer shape `pin_rows` would pin (numerics.py's probe)."""
    return fixed_count_rows_hold(plain_linears(model), ROWS, _PROBE_OFFSETS)


def plain_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's `torch.nn.Linear` layers, not subclasses (whose forward may differ)."""
    return [m for m in model.modules()
            if isinstance(m, torch.nn.Linear) and type(m) in (torch.nn.Linear, PinnedLinear)]
