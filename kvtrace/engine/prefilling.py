"""The one prefill function: compute or reuse the KV of a token sequence.

Canonical prefill — what makes a cache hit bit-identical to a cold run:

1. Every forward pass runs a number of rows that is a multiple of
   `ROW_MULTIPLE` (16): the real rows, then padding rows (after the real
   ones, so causality hides them; their KV is cropped at once). CPU GEMMs
   give a row the same bits whatever the row count from 12 rows up; below
   that (1-3, 5-7, 9-11 rows: a short tail) they do not, so no forward ever
   runs fewer than 16 rows. Chunks start wherever the reuse ends and hold up
   to `MAX_CHUNK_ROWS` real rows (a bound on attention temporaries, not a
   numeric choice).
2. Attention is `kvtrace.engine.attention.canonical_attention`, whose
   reductions do not depend on how many keys follow a row, nor on how many
   query rows share its forward.

The result: a row's KV is a function of the tokens up to it only, so reusing
cached rows at any offset, memory or disk, gives the same bits as
recomputing them, and a hit costs the rows it computes (at most 15 padding
rows per forward). Logits come from the last real row (or, with
`logits_from`, from every row from there on: how generation.py checks a draft).

Reused KV is assembled once per prefill: when one of the cache's live
sequences (the last ones computed, see cache.py) covers the hit, its buffers
are taken over with no copy (kvbuffer.py); else each layer's buffer is
filled from the tree's pieces and disk blocks. An exact repeat that asks for
no KV only counts its hit, and leaves the live buffers to their run.

Rules kept here for every caller:
- reuse the whole sequence only when the cache kept its last logits
  (`KVCache.last_logits`: an exact repeat computes nothing); else the last
  token is always computed, since its logits are the output (transformers
  5.x silently misbehaves given a cache that covers the whole prompt);
- only canonical KV is stored (a decoded output is re-prefilled, at once or,
  deferred, by the next prompt's prefill: generation.py);
- everything computed is stored: the new tail in memory (borrowed from the
  live buffers, radix.py), every full block not yet on disk; the sequence
  becomes the cache's newest live one. "Feeding" recorded
  output (replay's rebuild) is `prefill(engine, cache, prompt_ids + output_ids)`.

Models with sliding-window or recurrent layers (layers.py) take the other
path, given a `StateCache`: block-aligned chunks and a state per block
(stateprefill.py), the same result type, with `kv` a `ModelState`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from kvtrace.engine.attention import KV_KWARG
from kvtrace.engine.cache import DEFAULT_BLOCK_SIZE, KVCache, PrefixHit, check_block_size
from kvtrace.engine.kvbuffer import buffer_rows, growing_cache, growing_layers
from kvtrace.engine.model import Engine
from kvtrace.engine.radix import KVSource
from kvtrace.engine.rowblocks import canonical_products
from kvtrace.engine.statecache import PrefixCache, StateCache
from kvtrace.engine.stateprefill import prefill_states
from kvtrace.engine.threads import engine_threads
from kvtrace.errors import CacheError, UsageError

_PAD_TOKEN = 0
ROW_MULTIPLE = 16
MAX_CHUNK_ROWS = 512


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """Logits (of the last position, or of a span), KV of every position, and their source.

    `kv` is a transformers `DynamicCache` covering all `num_tokens` tokens,
    ready for decoding; its rows are views of buffers the cache shares, valid
    until the next prefill on the same cache (kvbuffer.py). `kv` is None in
    a result kept only for its counts (a rejected draft's), and when the caller asked
    for none (`need_kv`).
    `num_memory_tokens + num_disk_tokens + num_computed_tokens ==
    num_tokens`. `logits` is the last position's logits, or with
    `logits_from` one row per position from there to the end (each passed
    through `reduce_logits` when one was given).
    `num_deferred_tokens` are part of `num_computed_tokens` (and not of
    `num_cached_tokens`): an earlier generation's output that the cache
    owed, computed here (see `KVCache.defer`); replay counts them as reused.
    """

    logits: torch.Tensor
    kv: object
    num_tokens: int
    num_memory_tokens: int
    num_disk_tokens: int
    num_computed_tokens: int
    seconds: float
    num_deferred_tokens: int = 0

    @property
    def num_cached_tokens(self) -> int:
        return self.num_memory_tokens + self.num_disk_tokens


def prefill(
    engine: Engine,
    cache: PrefixCache | None,
    token_ids: Sequence[int],
    *,
    block_size: int | None = None,
    logits_from: int | None = None,
    reduce_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    need_kv: bool = True,
) -> PrefillResult:
    """Compute (or reuse) the KV of `token_ids` and the logits after the last one.

    `cache=None` computes everything (the same canonical way). `block_size`
    is checked (a multiple of 16; with a cache, equal to its block size); on
    the full-attention path it no longer shapes the chunks (any split gives
    the same bits), on the block-state path it does (stateprefill.py): a
    cold run matches a cache's hits at that cache's block size. `logits_from` asks for the logits
    of every position from that index on (reuse stops there, so they are
    computed), one row each; `reduce_logits` maps each chunk's rows as they
    are computed, so a long span never holds vocabulary-wide rows in full.
    `need_kv=False` says the caller reads only the logits (a generation of one
    token): an exact repeat then assembles no KV either, and `kv` is None
    (copying a 3,000-token prefix out of the tree costs ~50 ms on CPU).
    """
    tokens = [int(t) for t in token_ids]
    engine_threads().adjust()  # on the cores other processes leave free (threads.py)
    if not tokens:
        raise UsageError("cannot prefill an empty token sequence")
    if min(tokens) < 0 or max(tokens) >= engine.vocab_size:
        bad = next(t for t in tokens if not 0 <= t < engine.vocab_size)
        raise UsageError(
            f"token id {bad} is outside the vocabulary of {engine.name} "
            f"(0..{engine.vocab_size - 1})"
        )
    if isinstance(cache, KVCache) and not engine.layout.is_plain:
        raise UsageError(f"{engine.name} has {engine.layout.describe()}: give it a StateCache "
                         f"(open_cache picks the cache a model needs)")
    if cache is not None:
        if block_size is not None and block_size != cache.block_size:
            raise UsageError(f"block_size {block_size} differs from the cache's {cache.block_size}")
        if cache.fingerprint != engine.fingerprint:
            raise CacheError("this KV cache belongs to another engine (fingerprints differ)")
    else:
        check_block_size(block_size if block_size is not None else DEFAULT_BLOCK_SIZE)
    keep_from = len(tokens) - 1 if logits_from is None else logits_from
    if not 0 <= keep_from < len(tokens):
        raise UsageError(f"logits_from {logits_from} is outside the {len(tokens)} tokens")
    started = time.perf_counter()
    if isinstance(cache, StateCache) or (cache is None and not engine.layout.is_plain):
        size = cache.block_size if cache is not None else block_size or DEFAULT_BLOCK_SIZE
        logits, state, found = prefill_states(
            engine, cache, tokens, block_size=size, keep_from=keep_from,
            plain=logits_from is None and reduce_logits is None, reduce_logits=reduce_logits)
        return PrefillResult(
            logits=logits if logits_from is not None else logits[-1],
            kv=state if need_kv else None,
            num_tokens=len(tokens),
            num_memory_tokens=found.num_memory_tokens if found is not None else 0,
            num_disk_tokens=found.num_disk_tokens if found is not None else 0,
            num_computed_tokens=len(tokens) - (found.num_tokens if found is not None else 0),
            seconds=time.perf_counter() - started,
            num_deferred_tokens=found.num_deferred_tokens if found is not None else 0,
        )
    kv = growing_cache(engine.model.config)
    layers = growing_layers(kv)
    # Only the plain last-position logits are kept; a repeat of a sequence whose
    # logits the cache kept may reuse every token.
    plain = logits_from is None and reduce_logits is None
    known = cache.last_logits(tokens) if cache is not None and plain else None
    limit = len(tokens) if known is not None else keep_from
    if cache is not None and known is not None and not need_kv:
        # Likely nothing to compute, nothing to store, and no KV asked for: counted
        # without taking the KV (a live sequence stays live for its run's next call).
        counted = cache.lookup(tokens, max_tokens=limit, kv=False)
        cache.release(counted)
        if counted.num_tokens == len(tokens):
            return _result(known.unsqueeze(0), None, counted, len(tokens), started, logits_from)
    hit = cache.lookup(tokens, max_tokens=limit) if cache is not None else None
    try:
        reused = hit.num_tokens if hit is not None else 0
        if hit is not None and hit.live is not None:
            for layer, buffer in zip(layers, hit.live, strict=True):
                layer.adopt(buffer, reused)
        elif hit is not None and hit.pieces:
            rows = sum(int(k.shape[2]) for k, _ in hit.pieces)
            if rows != reused:
                raise CacheError(f"cache returned {rows} KV rows for {reused} tokens")
            for i, layer in enumerate(layers):
                layer.seed([(k[i].unsqueeze(0), v[i].unsqueeze(0)) for k, v in hit.pieces])
        if hit is not None:
            # Drop the hit's references: the tree's pieces were copied into
            # the buffers, the live ones taken over (the tree still borrows
            # their rows below `reused`, which nothing overwrites).
            hit = replace(hit, live=None, pieces=())
        if known is not None and reused == len(tokens):
            logits = known.unsqueeze(0)
        else:
            span = logits_from is not None
            logits = _compute(engine, kv, tokens, reused, keep_from, span, reduce_logits)
            if cache is not None and plain:
                cache.remember_logits(tokens, logits[-1])
        if cache is not None and hit is not None:
            cache.store(tokens, layers, num_disk_blocks=hit.num_disk_blocks)
    finally:
        if cache is not None and hit is not None:
            cache.release(hit)
    return _result(logits, kv, hit, len(tokens), started, logits_from)


def _result(logits: torch.Tensor, kv: object, hit: PrefixHit | None, num_tokens: int,
            started: float, logits_from: int | None) -> PrefillResult:
    reused = hit.num_tokens if hit is not None else 0
    return PrefillResult(
        logits=logits if logits_from is not None else logits[-1],
        kv=kv,
        num_tokens=num_tokens,
        num_memory_tokens=hit.num_memory_tokens if hit is not None else 0,
        num_disk_tokens=hit.num_disk_tokens if hit is not None else 0,
        num_computed_tokens=num_tokens - reused,
        seconds=time.perf_counter() - started,
        num_deferred_tokens=hit.num_deferred_tokens if hit is not None else 0,
    )


def _compute(
    engine: Engine,
    kv: object,
    tokens: list[int],
    start: int,
    keep_from: int,
    span: bool,
    reduce_logits: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """Run tokens[start:] through the model in canonical padded chunks.

    Returns the logits of positions keep_from.. (one row each, float32,
    mapped by `reduce_logits` chunk by chunk). The last position alone goes
    through the output layer as one row on every path; a `span` of rows is
    widened to at least ROW_MULTIPLE rows per forward (then cut back), since
    how the span splits into forwards depends on where the reuse ended.
    """
    n = len(tokens)
    pos = start
    rows: list[torch.Tensor] = []
    device = engine.device
    try:
        with torch.inference_mode(), canonical_products():
            while pos < n:
                end = min(n, pos + MAX_CHUNK_ROWS)
                real = end - pos
                width = -(-real // ROW_MULTIPLE) * ROW_MULTIPLE
                chunk = torch.full((1, width), _PAD_TOKEN, dtype=torch.long, device=device)
                chunk[0, :real] = torch.tensor(tokens[pos:end], dtype=torch.long, device=device)
                positions = torch.arange(pos, pos + width, device=device).unsqueeze(0)
                if end > keep_from:
                    lo = max(keep_from, pos) - pos
                    first = min(lo, width - ROW_MULTIPLE) if span else lo
                    last = max(real, first + ROW_MULTIPLE) if span else real
                    keep = torch.arange(first, last, device=device)
                    out = engine.model(
                        input_ids=chunk,
                        position_ids=positions,
                        cache=kv,
                        use_cache=True,
                        logits_to_keep=keep,
                        **{KV_KWARG: kv},
                    )
                    kept = out.logits[0, lo - first : real - first].float()
                    rows.append(reduce_logits(kept) if reduce_logits is not None else kept)
                else:
                    engine.model.base_model(
                        input_ids=chunk, position_ids=positions, cache=kv, use_cache=True,
                        **{KV_KWARG: kv},
                    )
                if real < width:
                    kv.crop(real - width)  # type: ignore[attr-defined]
                pos = end
    except RuntimeError as exc:  # torch errors: out of memory, bad ids …
        raise CacheError(f"the model failed during prefill: {exc}") from exc
    if not rows:
        raise CacheError("prefill computed no token (the cache covered the whole sequence)")
    return torch.cat(rows) if len(rows) > 1 else rows[0]


def kv_rows(kv: object) -> KVSource:
    """A KVSource over a prefill's DynamicCache: stacked copies of rows [start, end)."""
    if not isinstance(kv, DynamicCache):
        raise CacheError("not a prefill's DynamicCache")
    buffers = [layer.buffer for layer in growing_layers(kv)]
    if any(buffer is None for buffer in buffers):
        raise CacheError("this DynamicCache holds no KV")
    return buffer_rows([b for b in buffers if b is not None])
