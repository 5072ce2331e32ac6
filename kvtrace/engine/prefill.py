"""The one prefill function: compute or reuse the KV of a token sequence.

Canonical prefill — what makes a cache hit bit-identical to a cold run:

1. Chunks end at absolute multiples of `block_size` (a chunk starting at a
   cached offset mid-block runs to the next boundary), on the cached and the
   uncached path alike.
2. Every chunk is padded to exactly `block_size` rows (the padding rows come
   after the real ones, so causality hides them; their KV is cropped at
   once). Every matmul therefore has the same shape whichever path computed a
   row, and CPU GEMMs are row-invariant at a fixed shape (they are not when
   the row count varies below ~12, which a 1-token tail would hit).
3. Attention is `kvtrace.engine.attention.canonical_attention`, whose
   reductions do not depend on how many keys follow a row.

The result: a row's KV is a function of the tokens up to it only, so reusing
cached rows at any offset, memory or disk, gives the same bits as
recomputing them. The cost is at most `block_size - 1` padding rows per
prefill. Logits come from the last real row (or, with `logits_from`, from
every row from there on: how generate.py checks a draft).

Rules kept here for every caller:
- never reuse the whole sequence: the last token is always computed, since
  its logits are the output (transformers 5.x silently misbehaves given a
  cache that covers the whole prompt);
- only canonical KV is stored (generate.py re-prefills decoded output);
- everything computed is stored: the new tail in memory, every full block not
  yet on disk. "Feeding" recorded output (replay's rebuild) is
  `prefill(engine, cache, prompt_ids + output_ids)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtrace.engine.cache import DEFAULT_BLOCK_SIZE, KVCache, check_block_size
from kvtrace.engine.model import Engine
from kvtrace.engine.radix import KVSource
from kvtrace.errors import CacheError, UsageError

_PAD_TOKEN = 0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """Logits (of the last position, or of a span), KV of every position, and their source.

    `kv` is a transformers `DynamicCache` covering all `num_tokens` tokens,
    ready for decoding. `num_memory_tokens + num_disk_tokens +
    num_computed_tokens == num_tokens`. `logits` is the last position's
    logits, or with `logits_from` one row per position from there to the
    end (each passed through `reduce_logits` when one was given). `kv` is
    None in a result kept only for its counts (a rejected draft's).
    """

    logits: torch.Tensor
    kv: object
    num_tokens: int
    num_memory_tokens: int
    num_disk_tokens: int
    num_computed_tokens: int
    seconds: float

    @property
    def num_cached_tokens(self) -> int:
        return self.num_memory_tokens + self.num_disk_tokens


def prefill(
    engine: Engine,
    cache: KVCache | None,
    token_ids: Sequence[int],
    *,
    block_size: int | None = None,
    logits_from: int | None = None,
    reduce_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> PrefillResult:
    """Compute (or reuse) the KV of `token_ids` and the logits after the last one.

    `cache=None` computes everything (the same canonical way); `block_size`
    then sets the chunk length (default 64) and must equal the cache's block
    size for results to match a cached run. `logits_from` asks for the logits
    of every position from that index on (reuse stops there, so they are
    computed), one row each; `reduce_logits` maps each chunk's rows as they
    are computed, so a long span never holds vocabulary-wide rows in full.
    """
    tokens = [int(t) for t in token_ids]
    if not tokens:
        raise UsageError("cannot prefill an empty token sequence")
    if min(tokens) < 0 or max(tokens) >= engine.vocab_size:
        bad = next(t for t in tokens if not 0 <= t < engine.vocab_size)
        raise UsageError(
            f"token id {bad} is outside the vocabulary of {engine.name} "
            f"(0..{engine.vocab_size - 1})"
        )
    if cache is not None:
        if block_size is not None and block_size != cache.block_size:
            raise UsageError(f"block_size {block_size} differs from the cache's {cache.block_size}")
        if cache.fingerprint != engine.fingerprint:
            raise CacheError("this KV cache belongs to another engine (fingerprints differ)")
        block = cache.block_size
    else:
        block = block_size if block_size is not None else DEFAULT_BLOCK_SIZE
        check_block_size(block)
    keep_from = len(tokens) - 1 if logits_from is None else logits_from
    if not 0 <= keep_from < len(tokens):
        raise UsageError(f"logits_from {logits_from} is outside the {len(tokens)} tokens")
    started = time.perf_counter()
    from transformers import DynamicCache

    kv = DynamicCache(config=engine.model.config)
    hit = cache.lookup(tokens, max_tokens=keep_from) if cache is not None else None
    try:
        reused = hit.num_tokens if hit is not None else 0
        if hit is not None and hit.pieces:
            keys = _join([k for k, _ in hit.pieces])
            values = _join([v for _, v in hit.pieces])
            if keys.shape[3] != reused:
                raise CacheError(f"cache returned {keys.shape[3]} KV rows for {reused} tokens")
            _seed_cache(kv, keys, values)
        logits = _compute(engine, kv, tokens, reused, block, keep_from, reduce_logits)
        if cache is not None and hit is not None:
            cache.insert(tokens, kv_rows(kv), num_disk_blocks=hit.num_disk_blocks)
    finally:
        if cache is not None and hit is not None:
            cache.release(hit)
    return PrefillResult(
        logits=logits if logits_from is not None else logits[-1],
        kv=kv,
        num_tokens=len(tokens),
        num_memory_tokens=hit.num_memory_tokens if hit is not None else 0,
        num_disk_tokens=hit.num_disk_tokens if hit is not None else 0,
        num_computed_tokens=len(tokens) - reused,
        seconds=time.perf_counter() - started,
    )


def _compute(
    engine: Engine,
    kv: object,
    tokens: list[int],
    start: int,
    block: int,
    keep_from: int,
    reduce_logits: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """Run tokens[start:] through the model in canonical padded chunks.

    Returns the logits of positions keep_from.. (one row each, float32,
    mapped by `reduce_logits` chunk by chunk).
    """
    n = len(tokens)
    pos = start
    rows: list[torch.Tensor] = []
    device = engine.device
    try:
        with torch.inference_mode():
            while pos < n:
                end = min(n, (pos // block + 1) * block)
                real = end - pos
                chunk = torch.full((1, block), _PAD_TOKEN, dtype=torch.long, device=device)
                chunk[0, :real] = torch.tensor(tokens[pos:end], dtype=torch.long, device=device)
                positions = torch.arange(pos, pos + block, device=device).unsqueeze(0)
                if end > keep_from:
                    keep = torch.arange(max(keep_from, pos) - pos, real, device=device)
                    out = engine.model(
                        input_ids=chunk,
                        position_ids=positions,
                        cache=kv,
                        use_cache=True,
                        logits_to_keep=keep,
                    )
                    kept = out.logits[0].float()
                    rows.append(reduce_logits(kept) if reduce_logits is not None else kept)
                else:
                    engine.model.base_model(
                        input_ids=chunk, position_ids=positions, cache=kv, use_cache=True
                    )
                if real < block:
                    kv.crop(real - block)  # type: ignore[attr-defined]
                pos = end
    except RuntimeError as exc:  # torch errors: out of memory, bad ids …
        raise CacheError(f"the model failed during prefill: {exc}") from exc
    if not rows:
        raise CacheError("prefill computed no token (the cache covered the whole sequence)")
    return torch.cat(rows) if len(rows) > 1 else rows[0]


def _join(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate `[layers, heads, n, dim]` pieces into `[layers, 1, heads, N, dim]`.

    One copy, already in the per-layer layout DynamicCache holds.
    """
    return torch.cat([p.unsqueeze(1) for p in pieces], dim=3)


def _seed_cache(kv: object, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Load reused KV into an empty DynamicCache without a second copy."""
    for index, layer in enumerate(kv.layers):  # type: ignore[attr-defined]
        layer.lazy_initialization(keys[index], values[index])
        layer.keys, layer.values = keys[index], values[index]


def kv_rows(kv: object) -> KVSource:
    """A KVSource over a DynamicCache: stacked copies of rows [start, end)."""
    layers = kv.layers  # type: ignore[attr-defined]

    def source(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.stack([layer.keys[0, :, start:end] for layer in layers])
        values = torch.stack([layer.values[0, :, start:end] for layer in layers])
        return keys, values

    return source
