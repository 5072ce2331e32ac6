"""The one prefill function, and generation on top of it.

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

The result: a row's KV and a position's logits are a function of the tokens
up to it only, so reusing cached rows at any offset, memory or disk, gives
the same bits as recomputing them. The cost is at most `block_size - 1`
padding rows per prefill. Logits come from the last real row only.

Rules kept here for every caller:
- never reuse the whole sequence: the last token is always computed, since
  its logits are the output (transformers 5.x silently misbehaves given a
  cache that covers the whole prompt);
- only canonical KV is stored: decode steps (one row at a time) are not
  canonical, so after generation the output tokens are re-prefilled
  canonically on top of the cached prompt (`insert_output=True`) — cheap, and
  it lets the next step's prompt, which contains them, hit in full;
- everything computed is stored: the new tail in memory, every full block not
  yet on disk. "Feeding" recorded output (replay's rebuild) is
  `prefill(engine, cache, prompt_ids + output_ids)`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvtrace.engine.cache import DEFAULT_BLOCK_SIZE, KVCache, check_block_size
from kvtrace.engine.model import Engine
from kvtrace.engine.radix import KVSource
from kvtrace.errors import CacheError, UsageError

_PAD_TOKEN = 0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """Logits of the last position, KV of every position, and where it came from.

    `kv` is a transformers `DynamicCache` covering all `num_tokens` tokens,
    ready for decoding. `num_memory_tokens + num_disk_tokens +
    num_computed_tokens == num_tokens`.
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


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """Generated tokens, why generation stopped, and the time spent where.

    `finish_reason` is "stop" (a stop token was produced, and is included in
    `token_ids`) or "length". `seed` is the sampling seed actually used
    (None when greedy). `insert_seconds` is the canonical re-prefill of the
    output into the cache.
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prefill: PrefillResult
    decode_seconds: float
    insert_seconds: float
    seed: int | None


def prefill(
    engine: Engine,
    cache: KVCache | None,
    token_ids: Sequence[int],
    *,
    block_size: int | None = None,
) -> PrefillResult:
    """Compute (or reuse) the KV of `token_ids` and the logits after the last one.

    `cache=None` computes everything (the same canonical way); `block_size`
    then sets the chunk length (default 64) and must equal the cache's block
    size for results to match a cached run.
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
    started = time.perf_counter()
    from transformers import DynamicCache

    kv = DynamicCache(config=engine.model.config)
    hit = cache.lookup(tokens, max_tokens=len(tokens) - 1) if cache is not None else None
    try:
        reused = hit.num_tokens if hit is not None else 0
        if hit is not None and hit.pieces:
            keys = _join([k for k, _ in hit.pieces])
            values = _join([v for _, v in hit.pieces])
            if keys.shape[3] != reused:
                raise CacheError(f"cache returned {keys.shape[3]} KV rows for {reused} tokens")
            _seed_cache(kv, keys, values)
        logits = _compute(engine, kv, tokens, reused, block)
        if cache is not None and hit is not None:
            cache.insert(tokens, _kv_rows(kv), num_disk_blocks=hit.num_disk_blocks)
    finally:
        if cache is not None and hit is not None:
            cache.release(hit)
    return PrefillResult(
        logits=logits,
        kv=kv,
        num_tokens=len(tokens),
        num_memory_tokens=hit.num_memory_tokens if hit is not None else 0,
        num_disk_tokens=hit.num_disk_tokens if hit is not None else 0,
        num_computed_tokens=len(tokens) - reused,
        seconds=time.perf_counter() - started,
    )


def generate(
    engine: Engine,
    cache: KVCache | None,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_ids: Iterable[int] | None = None,
    insert_output: bool = True,
    block_size: int | None = None,
) -> GenerateResult:
    """Prefill `prompt_ids`, then decode up to `max_new_tokens` tokens.

    Greedy when `temperature == 0`; otherwise temperature + nucleus (`top_p`)
    sampling from a `torch.Generator` seeded with `seed` (a fresh random seed
    when None, returned in the result). Stops after any of `stop_ids`
    (default: the engine's end-of-sequence ids).
    """
    if max_new_tokens < 0:
        raise UsageError("max_new_tokens must be >= 0")
    if temperature < 0 or not 0 < top_p <= 1:
        raise UsageError("temperature must be >= 0 and top_p in (0, 1]")
    stops = set(engine.eos_token_ids if stop_ids is None else (int(s) for s in stop_ids))
    pre = prefill(engine, cache, prompt_ids, block_size=block_size)
    generator: torch.Generator | None = None
    used_seed: int | None = None
    if temperature > 0:
        generator = torch.Generator(device=engine.device)
        used_seed = int(seed) if seed is not None else int(torch.seed() % (2**63))
        generator.manual_seed(used_seed)
    started = time.perf_counter()
    out: list[int] = []
    finish = "length"
    logits = pre.logits
    with torch.inference_mode():
        for step in range(max_new_tokens):
            token = _choose(logits, temperature, top_p, generator)
            out.append(token)
            if token in stops:
                finish = "stop"
                break
            if step + 1 == max_new_tokens:
                break
            result = engine.model(
                input_ids=torch.tensor([[token]], device=engine.device),
                cache=pre.kv,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = result.logits[0, -1].float()
    decode_seconds = time.perf_counter() - started
    insert_seconds = 0.0
    if insert_output and cache is not None and out:
        # Store prompt + output canonically: the prompt is cached (it was
        # just prefilled), so only the output tokens are computed.
        insert_seconds = prefill(engine, cache, [*prompt_ids, *out]).seconds
    return GenerateResult(
        token_ids=tuple(out),
        text=engine.decode(out),
        finish_reason=finish,
        prefill=pre,
        decode_seconds=decode_seconds,
        insert_seconds=insert_seconds,
        seed=used_seed,
    )


def _compute(engine: Engine, kv: object, tokens: list[int], start: int, block: int) -> torch.Tensor:
    """Run tokens[start:] through the model in canonical padded chunks."""
    n = len(tokens)
    pos = start
    logits: torch.Tensor | None = None
    device = engine.device
    try:
        with torch.inference_mode():
            while pos < n:
                end = min(n, (pos // block + 1) * block)
                real = end - pos
                chunk = torch.full((1, block), _PAD_TOKEN, dtype=torch.long, device=device)
                chunk[0, :real] = torch.tensor(tokens[pos:end], dtype=torch.long, device=device)
                positions = torch.arange(pos, pos + block, device=device).unsqueeze(0)
                if end == n:
                    out = engine.model(
                        input_ids=chunk,
                        position_ids=positions,
                        cache=kv,
                        use_cache=True,
                        logits_to_keep=torch.tensor([real - 1], device=device),
                    )
                    logits = out.logits[0, -1].float()
                else:
                    engine.model.base_model(
                        input_ids=chunk, position_ids=positions, cache=kv, use_cache=True
                    )
                if real < block:
                    kv.crop(real - block)  # type: ignore[attr-defined]
                pos = end
    except RuntimeError as exc:  # torch errors: out of memory, bad ids …
        raise CacheError(f"the model failed during prefill: {exc}") from exc
    if logits is None:
        raise CacheError("prefill computed no token (the cache covered the whole sequence)")
    return logits


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


def _kv_rows(kv: object) -> KVSource:
    """A KVSource over a DynamicCache: stacked copies of rows [start, end)."""
    layers = kv.layers  # type: ignore[attr-defined]

    def source(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.stack([layer.keys[0, :, start:end] for layer in layers])
        values = torch.stack([layer.values[0, :, start:end] for layer in layers])
        return keys, values

    return source


def _choose(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    if temperature == 0 or generator is None:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
