"""Shape-invariant causal attention: the numeric half of the fidelity scheme.

Why this exists: a cached prefix is only worth reusing if continuing from it
gives *bit-identical* KV and logits to computing the whole prompt cold. On
torch CPU (MKL, fp32) that is not automatic. Measured on this project's
machines (torch 2.13, transformers 5.24, SmolLM2-135M):

- `F.linear` gives a row a different result depending on how many rows are
  multiplied with it when that count is small (1-3, 5-7, 9-11 rows), and is
  row-invariant from 12 rows up. `kvtrace.engine.prefilling` therefore always
  runs chunks of exactly `block_size` rows (padding the tail), so every
  linear layer sees the same shape on the cached and the uncached path.
- `sdpa` (and `eager`) attention reduce over the key axis in steps whose
  boundaries depend on the total key length, so a query row attending to the
  same keys gives a slightly different result (~1e-5) when the chunk starts
  elsewhere. Even with padded chunks, `sdpa` broke parity for every split
  point after 128 tokens.

This module registers an attention function (`ATTN_IMPLEMENTATION`) whose
every floating-point reduction has a fixed shape or a fixed order: keys are
cut into tiles of `TILE` tokens at absolute positions 0, TILE, 2·TILE …;
the scores of a query row over all its tiles come from one product (each
score one `head_dim`-term dot product); a row's softmax runs in one fused pass
(torch's last-dimension kernel: the row max, exact in any order, then one
running vector sum whose lane and order depend on a key's index only, so
the masked keys after the row add exact zeros wherever the row ends); the
normalised probabilities are multiplied with the values tile by tile
(batched matmuls of fixed shape), and the tile partial sums combined by a
fixed fold over a power-of-two number of tiles (see `_fold_tiles`). Masked
keys contribute exact zeros, so a query row gets the same bits whether its
chunk holds 1 or 64 real rows, and whether the kv length ends just after it
or a tile later. The parity tests in tests/engine hold this line.

Where torch's fused CPU kernel keeps a row's bits too (`flash_rows_hold`) and
the tiles are not clearly the faster on this machine and dtype (`flash_is_faster`;
both probed once per machine in kernel_probes.py, kept by memo.py), prefill attention goes
through it instead (`flash_attention`: keys zero-padded to whole blocks of `FLASH_BLOCK`,
an additive causal mask), so no score matrix is written and read back; the engine's
fingerprint names which of the two computed its KV. The tiles stay for where
it does not hold or is clearly slower (bfloat16 on an AVX-512 BF16 EPYC, whose BF16
dot products the tiles' score products use and the fused kernel does not).

The tiles cost the FLOPs of plain attention plus temporaries of
`kv_heads * tiles * rows * TILE` floats. They are bounded: a forward of more
than `QUERY_BLOCK_ROWS` rows, or whose scores would pass `SCORE_BYTES`, is
split into blocks of query rows (a multiple of 16 each), each attending to
the keys up to its last row: the computation of a prefill chunk ending there,
so a row keeps its bits by the rules above. They live in per-thread buffers
kept from call to call (`scratch`). What each choice saved is measured in
docs/benchmarks.md.

Decode steps (one query row per sequence, decode.py) go to
`decode_attention.py` (torch's flash kernel, a shared prompt's keys read
once), routed by the step's `RowRouter` (the `ROUTER_KWARG` model argument).
Decoded KV is never stored (generation.py), and the cached and uncached
paths, alone or batched, decode identically from identical KV, so greedy
tokens still match bit for bit.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import torch
import torch.nn.functional as F

from kvtrace.engine.decode_attention import SequenceKV, decode_attention
from kvtrace.engine.kvbuffer import GrowingLayer

ATTN_IMPLEMENTATION = "kvtrace_canonical"
# torch's fused CPU kernel (`flash_attention`) splits the keys into blocks of 512 from key 0
# once there are that many; keys padded to a multiple of it make every block a full one.
FLASH_BLOCK = 512
KERNEL_ATTR = "_kvtrace_attention"  # on the model's config: "flash" where `flash_rows_hold`
FLASH = "flash"
# 128 keys: the value product's batched matmuls and the tile fold halve against 64 (an
# extension prefill ~6 % faster in bfloat16, docs/benchmarks.md); 256 pads too far.
TILE = 128
ROUTER_KWARG = "kvtrace_rows"  # a decode step's per-sequence K/V (decode.py's RowRouter)
# a prefill's cache (prefilling.py): `flash_attention` reads its buffers in place
KV_KWARG = "kvtrace_kv"
SCORE_BYTES = 32 * 1024**2
QUERY_BLOCK_ROWS = 256  # the most query rows one block scores (module docstring)
_QUERY_BLOCK_MULTIPLE = 16  # prefill's ROW_MULTIPLE: blocks are row counts a forward may have

_registered = False


def canonical_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention for one sequence whose queries are the last `q` keys.

    `query` is `[1, heads, q, dim]`, `key`/`value` are `[1, kv_heads, kv, dim]`
    with the queries at absolute positions `kv - q … kv - 1`. The attention
    mask transformers passes is ignored on purpose (it is `None` for custom
    implementations): causality is rebuilt from positions, which holds because
    kvtrace never left-pads or batches sequences.
    """
    q_len, head_dim = query.shape[2], query.shape[3]
    scale = scaling if scaling is not None else head_dim**-0.5
    router = kwargs.get(ROUTER_KWARG)
    if router is not None:
        return decode_attention(query, router.rows[module.layer_idx], router.groups, scale), None
    if q_len == 1:
        return decode_attention(query, [SequenceKV(key, value, 0)], [[0]], scale), None
    if getattr(getattr(module, "config", None), KERNEL_ATTR, None) == FLASH:
        in_place = _padded_in_place(kwargs.get(KV_KWARG), module, key, value)
        return flash_attention(query, key, value, scale, in_place), None
    return tiled_attention(query, key, value, scale), None


def tiled_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The same causal attention in fixed tiles (module docstring): `[b, q, heads, dim]`."""
    q_len, head_dim = query.shape[2], query.shape[3]
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    batch, num_heads = query.shape[0], query.shape[1]
    groups = num_heads // num_kv_heads
    num_tiles = -(-kv_len // TILE)
    padded = num_tiles * TILE
    key_tiles = _zero_padded("keys", key, padded)
    value_tiles = _zero_padded("values", value, padded)
    start = kv_len - q_len
    block = _query_block(q_len, num_tiles, num_kv_heads, groups, query.element_size())
    # [b, q, heads, dim], as transformers expects; each block's result is a view
    # of the scratch buffers, so it is copied out before the next block.
    out = query.new_empty(batch, q_len, num_heads, head_dim)
    for lo in range(0, q_len, block):
        # Queries lo..hi see keys up to start + hi: the tiles holding them.
        # Keys a tile holds past that are masked, contributing exact zeros.
        hi = min(q_len, lo + block)
        keys = -(-(start + hi) // TILE) * TILE
        rows = (query[:, :, lo:hi] * scale).reshape(
            batch, num_kv_heads, groups * (hi - lo), head_dim
        )
        total = _attend(rows, key_tiles[:, :, :keys], value_tiles[:, :, :keys],
                        start + lo, hi - lo, groups)
        out[:, lo:hi] = total.reshape(batch, num_heads, hi - lo, head_dim).transpose(1, 2)
    return out


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    in_place: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """The same causal attention through torch's fused kernel: `[b, q, heads, dim]`.

    Why it keeps a row's bits: the kernel gives each block of query rows to one thread, which
    walks the key blocks of `FLASH_BLOCK` from key 0 in order (a running max and sum, the
    value product added block by block). With the keys zero-padded to a multiple of the
    block, every block holds `FLASH_BLOCK` keys whatever the length; keys after a row are
    masked (-inf: exact zeros in its sums), and a block wholly after it changes nothing (its
    rescale factor is exactly 1). So a row gets the same bits in any chunk, at any length
    (`flash_rows_hold` checks that on this machine before the engine uses it). It reads no
    score matrix back: in float32 ~30 % faster than the tiles at 512 rows, ~15 % at 112.

    `in_place`: the same keys and values already padded, in the cache's own buffers (their
    rows past `key`'s zeros or earlier keys and values, `GrowingLayer.padded`): a masked
    key's score stays -inf whatever such a key holds, so it weighs an exact zero and the bits
    are those of zero padding, without copying each layer's whole KV (~5 % of an agent
    rebuild in float32, docs/benchmarks.md).
    """
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    q_len = query.shape[2]
    padded = -(-kv_len // FLASH_BLOCK) * FLASH_BLOCK
    if in_place is not None and in_place[0].shape[2] == padded:
        keys, values = in_place
    else:
        keys, values = _zero_padded("keys", key, padded), _zero_padded("values", value, padded)
    mask = _flash_mask(kv_len - q_len, q_len, padded, query.dtype, query.device)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=num_kv_heads != query.shape[1])
    return out.transpose(1, 2)


def _padded_in_place(kv: object, module: torch.nn.Module, key: torch.Tensor,
                     value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`key` and `value` padded to whole flash blocks where they lie, when `kv` is a prefill's
    cache of `GrowingLayer`s and they are exactly its layer's rows (the same memory and
    layout, not only the same length: every layer of a forward has that)."""
    layers = getattr(kv, "layers", None)
    layer_idx = getattr(module, "layer_idx", None)
    if layers is None or layer_idx is None or not 0 <= layer_idx < len(layers):
        return None
    layer = layers[layer_idx]
    if not isinstance(layer, GrowingLayer) or layer.get_seq_length() != key.shape[2]:
        return None
    padded = layer.padded(FLASH_BLOCK)
    if padded is None or any(
            whole.data_ptr() != part.data_ptr() or whole.stride() != part.stride()
            for whole, part in zip(padded, (key, value), strict=True)):
        return None
    return padded


def _zero_padded(name: str, rows: torch.Tensor, length: int) -> torch.Tensor:
    """`rows` `[b, kv_heads, kv, dim]` in this thread's scratch buffer `name`, zero rows after
    them up to `length` (masked keys and values must be finite: their weights are 0)."""
    batch, heads, kv_len, dim = rows.shape
    out = scratch(name, (batch, heads, length, dim), rows)
    out[:, :, :kv_len] = rows
    out[:, :, kv_len:] = 0
    return out


@functools.lru_cache(maxsize=4)
def _flash_mask(first_query: int, q_len: int, num_keys: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """0 where a query sees a key, -inf after it: `[q_len, num_keys]`, one per forward (every
    layer asks for the same)."""
    query_pos = torch.arange(first_query, first_query + q_len, device=device)
    after = torch.arange(num_keys, device=device)[None, :] > query_pos[:, None]
    return torch.zeros(after.shape, dtype=dtype, device=device).masked_fill_(after, float("-inf"))


def _query_block(q_len: int, num_tiles: int, num_kv_heads: int, groups: int,
                 element_size: int) -> int:
    """Query rows per block: a multiple of 16 whose scores fit SCORE_BYTES, at least 16
    and at most QUERY_BLOCK_ROWS.

    Prefill's forwards are multiples of 16 rows, so every block is too.
    """
    per_row = num_kv_heads * num_tiles * groups * TILE * element_size
    fits = SCORE_BYTES // per_row // _QUERY_BLOCK_MULTIPLE * _QUERY_BLOCK_MULTIPLE
    return min(q_len, QUERY_BLOCK_ROWS, max(_QUERY_BLOCK_MULTIPLE, fits))


def _attend(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            first_query: int, q_len: int, groups: int) -> torch.Tensor:
    """Attention of `rows` over the keys, summed tile by tile: `[b, kvh, rows, dim]`.

    `rows` `[b, kvh, groups * q_len, dim]` hold the queries at absolute
    positions `first_query …` (times `groups`); `keys` and `values`
    `[b, kvh, tiles * TILE, dim]` cover every key up to the last of them,
    zero-padded. Scores are laid out queries by keys, so each row's softmax
    is one contiguous pass (in place), and the value product reads each
    tile's probabilities as a `[rows, TILE]` block of them.
    """
    b, kvh, count, dim = rows.shape
    num_keys = keys.shape[2]
    tiles = num_keys // TILE
    scores = scratch("scores", (b, kvh, count, num_keys), rows)
    torch.matmul(rows, keys.transpose(-1, -2), out=scores)
    # Keys after a query can only lie in the tiles from the first query's own on.
    first = first_query // TILE * TILE
    scores[..., first:].masked_fill_(
        _causal_mask(first_query, q_len, tiles, groups, rows.device), float("-inf"))
    # In place (`_softmax`'s out= form): no new scores-sized tensor each layer call.
    probs = torch._softmax(scores, -1, False, out=scores)
    partial = scratch("partial", (b, kvh, tiles, count, dim), probs)
    # One batched product per sequence and kv head, each tile's `[rows, TILE]` block read
    # where it lies: a single product over every head would first copy all the scores
    # (the heads and tiles of a row-major score tensor do not merge into one batch axis).
    for i in range(b):
        for h in range(kvh):
            torch.bmm(probs[i, h].view(count, tiles, TILE).transpose(0, 1),
                      values[i, h].view(tiles, TILE, dim), out=partial[i, h])
    return _fold_tiles(partial)


def _fold_tiles(partial: torch.Tensor) -> torch.Tensor:
    """Sum dim 2 (tiles) in an order that trailing zero tiles cannot change.

    Tiles are zero-padded to a power of two, then halves are added
    (`x[:n/2] + x[n/2:]`) until one remains. If every tile past M (a power of
    two) is zero, the first folds add exact zeros and leave `x[:M]`, which then
    folds exactly as it would alone. A row's tiles past its own position are
    zero (masked), so its sum is the same however many tiles its chunk had.
    Unlike `sum`, whose grouping varies with length, and cheaper than a
    left-to-right loop of one op per tile.
    """
    num_tiles = partial.shape[2]
    span = 1 << (num_tiles - 1).bit_length()
    # In place (`partial` is the caller's temporary): the same additions, no new tensors.
    if span > num_tiles:
        # The first fold against the zero padding, without materialising it:
        # tiles with no partner keep their value (x + 0 == x exactly).
        half = span // 2
        partial[:, :, : num_tiles - half] += partial[:, :, half:]
        partial = partial[:, :, :half]
    while partial.shape[2] > 1:
        half = partial.shape[2] // 2
        partial[:, :, :half] += partial[:, :, half:]
        partial = partial[:, :, :half]
    return partial[:, :, 0]


class _Scratch(threading.local):
    """This thread's temporaries, kept from call to call (see `scratch`)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}


_scratch = _Scratch()


def scratch(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of `shape` (contents undefined) over this thread's buffer `name`.

    Why: the tiles and scores of one layer are megabytes, allocated and freed
    30 times a forward. On a thread other than the process's first, glibc
    serves such blocks from fresh mappings each time (its per-thread arenas
    give them back at once), and the page faults and unmaps made a prefill
    in `kvtrace serve` ~1.4x slower (docs/benchmarks.md). Buffers grow by a
    quarter past the need, so a growing context reallocates rarely; one set
    per thread (the engine thread is the only one that prefills), kept
    until the thread ends: tens of MB at 5k tokens of context.
    """
    numel = math.prod(shape)
    buffer = _scratch.buffers.get(name)
    if (buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype
            or buffer.device != like.device):
        buffer = torch.empty(numel + numel // 4, dtype=like.dtype, device=like.device)
        _scratch.buffers[name] = buffer
    return buffer[:numel].view(shape)


@functools.lru_cache(maxsize=32)
def _causal_mask(
    first_query: int, q_len: int, num_tiles: int, groups: int, device: torch.device
) -> torch.Tensor:
    """True where a key lies after the query, over the tiles from the first query's on.

    `[groups * q_len, (num_tiles - first_query // TILE) * TILE]` (queries
    by keys, as `_attend` lays out its scores); small (a few tiles), and
    cached: every layer of one forward asks for the same masks.
    """
    first = first_query // TILE
    query_pos = (torch.arange(q_len, device=device) + first_query).repeat(groups)
    key_pos = torch.arange(first * TILE, num_tiles * TILE, device=device)
    return key_pos[None, :] > query_pos[:, None]


def register_canonical_attention() -> str:
    """Register the function with transformers (idempotent); return its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, canonical_attention)
        _registered = True
    return ATTN_IMPLEMENTATION
