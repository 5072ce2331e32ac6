"""The numeric setting bit-identical reuse needs: GEMM rows that do not depend on the row count.

Canonical prefill (prefilling.py) gives a cached row the bits a cold run gives
it only if a matrix product computes each row the same way however many
rows it multiplies at once. Intel MKL, which torch's CPU build uses for
`F.linear`, does not promise that: with 2 threads on an AVX-512 Xeon
(2026-11-30, torch 2.13), a `[m, 1536] x [1536, 576]` product (the MLP's
down projection of the default model) gives rows other bits for m = 64-192
than for m <= 48 or m >= 208, because for those shapes MKL splits the
reduction over K between the threads. On an AVX2 path, m = 16 and 32 differ
instead. MKL's Conditional Numerical Reproducibility in strict mode
(`MKL_CBWR=AUTO,STRICT`) turns such splits off; measured on that machine
every linear shape of the model then agrees for m = 1-12 and every multiple
of 16 up to 600, 512-row products cost the same, and 1-row products
(decoding) ~1.5x more. Prefill still pads forwards to 16 rows: without the
padding the tiny models' parity tests fail even in strict mode.

MKL reads the setting once, at its first computation in the process, so
importing `kvtrace.engine` sets it (unless the environment already does;
this module imports no torch; `kvtrace.replay` and the CLI import the
package, for its `SamplingParams`, but `import kvtrace` alone, e.g. to trace
an agent, leaves the process's MKL as it was) before the engine computes
anything, and `load_engine` checks the property on the model's own layer
shapes (`rows_are_invariant`). bfloat16 products go to oneDNN, which strict
mode does not reach, and on CPUs with AMX they are not row-invariant: there
the engine multiplies in products of a fixed row count instead
(kvtrace/engine/rowblocks.py), and warns only where that fails too (e.g.
when torch computed something before `kvtrace.engine` was imported).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: `import kvtrace` loads this module first
    import torch

MKL_SETTING = ("MKL_CBWR", "AUTO,STRICT")
# Row counts (multiples of 16) checked against the same rows of a product of prefill's
# largest forward (MAX_CHUNK_ROWS); 336 and 496 differed from 512 under AMX.
CHECKED_ROWS = (16, 48, 64, 128, 192, 208, 336, 496)
REFERENCE_ROWS = 512


def native_bfloat16() -> bool | None:
    """Whether this CPU multiplies bfloat16 natively: True or False on x86, None elsewhere.

    Why: on x86 without AVX-512 BF16 or AMX, torch converts bfloat16 GEMMs
    the slow way. Measured on an AVX2 AMD EPYC (2026-12-03, torch 2.13): the
    default model's prefill ~14x slower than in float32 (35 s against 2.4 s
    for 512 tokens after 2,000), where AVX-512 BF16 made it ~2x faster.
    torch reports the x86 features only; other CPUs are not judged.
    """
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def request_reproducible_gemm() -> None:
    """Ask MKL for strict reproducibility, unless the user's environment says otherwise."""
    os.environ.setdefault(*MKL_SETTING)


def rows_are_invariant(model: torch.nn.Module) -> bool:
    """Whether each linear shape of the model's first layer computes rows independently of m.

    Random inputs, `CHECKED_ROWS` against the first rows of a
    `REFERENCE_ROWS`-row product (past the 64-192-row band seen to differ),
    per distinct weight shape: ~9 GFLOP, tens of milliseconds, for the
    default model; it grows with the layer width (seconds for a 7B model).
    """
    import torch
    import torch.nn.functional as F

    first = next((m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")), None)
    if first is None:
        return True
    generator = torch.Generator().manual_seed(0)
    layers = [m for m in first.modules() if isinstance(m, torch.nn.Linear)]
    with torch.inference_mode():
        for linear in distinct_shapes(layers, with_bias=False):
            weight = linear.weight
            rows = random_rows(weight, REFERENCE_ROWS, generator)
            reference = F.linear(rows, weight)
            for m in CHECKED_ROWS:
                if not torch.equal(F.linear(rows[:m], weight), reference[:m]):
                    return False
    return True


def threads_are_invariant(model: torch.nn.Module, most: int) -> bool:
    """Whether each linear shape of the model's first layer gives the same bits on every
    thread count below `most` as on `most` (engine/threads.py may change the count between
    a cold run and a hit), for decode's 1 row and prefill's 16, 128 and 512."""
    import torch
    import torch.nn.functional as F

    first = next((m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")), None)
    if first is None or most <= 1:
        return True
    generator = torch.Generator().manual_seed(0)
    layers = [m for m in first.modules() if isinstance(m, torch.nn.Linear)]
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for linear in distinct_shapes(layers, with_bias=True):
                rows = random_rows(linear.weight, REFERENCE_ROWS, generator)
                for m in (1, 16, 128, REFERENCE_ROWS):
                    torch.set_num_threads(most)
                    reference = F.linear(rows[:m], linear.weight, linear.bias)
                    for threads in range(1, most):
                        torch.set_num_threads(threads)
                        if not torch.equal(F.linear(rows[:m], linear.weight, linear.bias),
                                           reference):
                            return False
    finally:
        torch.set_num_threads(before)
    return True


def fixed_count_rows_hold(layers: Sequence[torch.nn.Linear], count: int,
                          offsets: Sequence[int]) -> bool:
    """Whether a product of exactly `count` rows gives a row the same bits wherever it sits
    among them, for each distinct shape of `layers` (bias included; random rows moved down
    by each of `offsets`); False if there are no layers."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    distinct = distinct_shapes(layers, with_bias=True)
    with torch.inference_mode():
        for layer in distinct:
            weight, bias = layer.weight, layer.bias
            rows = random_rows(weight, 2 * count, generator)
            reference = F.linear(rows[:count], weight, bias)
            for offset in offsets:
                moved = F.linear(torch.cat([rows[count:count + offset], rows[:count - offset]]),
                                 weight, bias)
                if not torch.equal(moved[offset:], reference[:count - offset]):
                    return False
    return bool(distinct)


def distinct_shapes(layers: Sequence[torch.nn.Linear], *, with_bias: bool) -> list[torch.nn.Linear]:
    """One layer per weight shape (and, `with_bias`, per whether it has a bias)."""
    shapes: dict[tuple[object, ...], torch.nn.Linear] = {}
    for layer in layers:
        key = (tuple(layer.weight.shape), with_bias and layer.bias is not None)
        shapes.setdefault(key, layer)
    return list(shapes.values())


def random_rows(weight: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` random rows for a product with `weight`, on its device and in its dtype."""
    import torch

    rows = torch.randn(count, weight.shape[1], generator=generator)
    return rows.to(device=weight.device, dtype=weight.dtype)
