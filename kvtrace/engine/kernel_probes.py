"""Which prefill attention kernel a load takes: two probes on the model's attention shape.

attention.py computes a prefill's attention in fixed tiles, or through torch's fused kernel
where that keeps a row's bits too; which one computed the KV changes its bits, so the
engine's fingerprint names it (model.py). Both questions are asked once per machine and
kept (memo.py): `flash_rows_hold`, a question of bits (does the fused kernel give a row the
same bits however its positions are cut into forwards, on every thread count), and
`flash_is_faster`, a timing (which of the two is the faster here, for this shape and
dtype), whose answer keeps the fused kernel unless the tiles are clearly the faster
(`prefers_flash`), so that two measurements near parity do not disagree on the bits (a
ratio near the threshold itself still could: rarer, not ruled out).
"""

from __future__ import annotations

import itertools
import math
import time

import torch

from kvtrace.engine import attention
from kvtrace.engine.attention import FLASH_BLOCK

# `flash_is_faster`'s shape: an agent's next call extending a cached conversation (~100-160
# new tokens over 2,000-5,000 in the fork and replay benchmarks); keys whole flash blocks.
_SPEED_ROWS, _SPEED_KEYS, _SPEED_TRIALS = 128, 6 * FLASH_BLOCK, 5
# The tiles replace the fused kernel only at this fraction of its time or less: near parity
# a timing may fall either way from one measurement to the next, and the kernel decides the
# bits (and the fingerprint), so two processes measuring apart should agree (`flash_is_faster`).
TILES_CLEARLY_FASTER = 0.8


def flash_rows_hold(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> bool:
    """Whether `flash_attention` gives every query row the same bits however its positions
    are cut into forwards (on random queries, keys and values of this shape, 1,104 positions)."""
    generator = torch.Generator().manual_seed(0)

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, 1104, head_dim, generator=generator).to(dtype=dtype,
                                                                             device=device)

    query, key, value = draw(num_heads), draw(num_kv_heads), draw(num_kv_heads)
    scale = head_dim**-0.5

    def attend(cuts: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([attention.flash_attention(query[:, :, a:b], key[:, :, :b],
                                                    value[:, :, :b], scale)
                          for a, b in itertools.pairwise(cuts)], dim=1)

    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            whole = attend((0, 512, 1024, 1104))
            if not all(torch.equal(attend(cuts), whole) for cuts in (
                    (0, 16, 528, 1040, 1104), (0, 112, 624, 1104), (0, 496, 1008, 1104))):
                return False
            torch.set_num_threads(1)  # the engine may compute on fewer (threads.py)
            return torch.equal(attend((0, 112, 624, 1104)), whole)
    except RuntimeError:  # a device or dtype the kernel does not take: the tiles
        return False
    finally:
        torch.set_num_threads(threads)


def flash_is_faster(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> bool:
    """Whether `flash_attention` computes a prefill's attention faster than the tiles on
    this machine, for this shape and dtype: the fastest of a few calls of each on an
    extension's shape (`_SPEED_ROWS` query rows after a cached prefix, `_SPEED_KEYS` keys in
    all), on the threads torch computes on now (the engine's most).

    Why a measurement: which is faster depends on the CPU and the dtype. On an AMD EPYC with
    AVX-512 BF16 (2026-12-07, torch 2.13) the fused kernel ran bfloat16 no faster than
    float32 (its small products and softmax passes do not use the BF16 dot products), and
    the default model's agent rebuild took 1.4x the tiles' time with it (1.5x on this
    shape); in float32 there it was the faster (0.95x on this shape, 0.8-0.95x on the
    rebuild), as in bfloat16 on a Xeon with AMX (docs/benchmarks.md).

    The answer is kept (memo.py), so the kernel, which the fingerprint names, does not flip
    between loads; but two processes that keep their answers apart (another cache folder, a
    deleted memo) each measure, and a fresh process must find the KV a first one left on
    disk. So the answer is "flash" unless the tiles are clearly the faster
    (`prefers_flash`): near parity, where either costs little, a timing's noise does not
    turn it (a true ratio near the threshold still could). ~0.1 s for the default model,
    once per machine.
    """
    generator = torch.Generator().manual_seed(1)

    def draw(heads: int, rows: int) -> torch.Tensor:
        return torch.randn(1, heads, rows, head_dim, generator=generator).to(dtype=dtype,
                                                                             device=device)

    query = draw(num_heads, _SPEED_ROWS)
    key, value = draw(num_kv_heads, _SPEED_KEYS), draw(num_kv_heads, _SPEED_KEYS)
    scale = head_dim**-0.5
    kernels = {  # each as a prefill calls it: flash reads whole blocks in place (a multiple)
        "flash": lambda: attention.flash_attention(query, key, value, scale, (key, value)),
        "tiles": lambda: attention.tiled_attention(query, key, value, scale),
    }
    best = dict.fromkeys(kernels, math.inf)
    with torch.inference_mode():
        for run in kernels.values():
            run()  # the first call allocates its scratch
        for _ in range(_SPEED_TRIALS):  # in turn, so a slow moment slows both
            for name, run in kernels.items():
                _synchronize(device)
                started = time.perf_counter()
                run()
                _synchronize(device)  # a GPU's kernels run after their launch returns
                best[name] = min(best[name], time.perf_counter() - started)
    return prefers_flash(best["flash"], best["tiles"])


def prefers_flash(flash_s: float, tiles_s: float) -> bool:
    """Whether the fused kernel's time against the tiles' keeps it: unless the tiles take
    at most `TILES_CLEARLY_FASTER` of its time (`flash_is_faster`)."""
    return tiles_s > TILES_CLEARLY_FASTER * flash_s


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
