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

Checking a draft (replay's verify): when the caller already holds the
response it expects — the recorded one — `generate(..., draft=ids)` runs
prompt + draft through ONE canonical prefill with the logits of every output
position, and makes the sampling decision of each position from them, as
speculative decoding verifies a draft model's tokens. If every decision
equals the draft and the draft ends where generation would end (a stop token,
or `max_new_tokens`), the draft is the result: no decoding loop, no
re-prefill of the output, and the cache holds prompt + output canonically.
Otherwise generation runs as usual from the prompt (already cached by then),
so a rejected draft changes nothing but the time spent. Accepted drafts equal
plain generation whenever the draft came from this engine (its decode chose
those very tokens, and the rare near-tie the two computations order
differently is a rejection, which falls back to decoding).
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
    num_computed_tokens == num_tokens`. `logits` holds one row per position
    from `logits_from` (default: the last position) to the end.
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
    (None when greedy). `prefill` is the call's first prefill, whose reuse is
    what the cache held for the prompt (the draft check's, when a draft was
    given); `prefill_seconds` is all prefill time, a rejected draft's
    included. `insert_seconds` is the canonical re-prefill of the output into
    the cache. `draft` is "accepted", "rejected" or None (no draft checked).
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prefill: PrefillResult
    prefill_seconds: float
    decode_seconds: float
    insert_seconds: float
    seed: int | None
    draft: str | None = None


def prefill(
    engine: Engine,
    cache: KVCache | None,
    token_ids: Sequence[int],
    *,
    block_size: int | None = None,
    logits_from: int | None = None,
) -> PrefillResult:
    """Compute (or reuse) the KV of `token_ids` and the logits after the last one.

    `cache=None` computes everything (the same canonical way); `block_size`
    then sets the chunk length (default 64) and must equal the cache's block
    size for results to match a cached run. `logits_from` asks for the logits
    of every position from that index on (reuse stops there, so they are
    computed), one row each.
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
        logits = _compute(engine, kv, tokens, reused, block, keep_from)
        if cache is not None and hit is not None:
            cache.insert(tokens, _kv_rows(kv), num_disk_blocks=hit.num_disk_blocks)
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
    draft: Sequence[int] | None = None,
) -> GenerateResult:
    """Prefill `prompt_ids`, then decode up to `max_new_tokens` tokens.

    Greedy when `temperature == 0`; otherwise temperature + nucleus (`top_p`)
    sampling from a `torch.Generator` seeded with `seed` (a fresh random seed
    when None, returned in the result). Stops after any of `stop_ids`
    (default: the engine's end-of-sequence ids). `draft` is the response the
    caller expects: it is checked in one prefill first (see the module
    docstring) and decoding runs only if it is rejected.
    """
    if max_new_tokens < 0:
        raise UsageError("max_new_tokens must be >= 0")
    if temperature < 0 or not 0 < top_p <= 1:
        raise UsageError("temperature must be >= 0 and top_p in (0, 1]")
    stops = set(engine.eos_token_ids if stop_ids is None else (int(s) for s in stop_ids))
    used_seed: int | None = None
    if temperature > 0:
        used_seed = int(seed) if seed is not None else int(torch.seed() % (2**63))
    sampling = _Sampling(temperature, top_p, used_seed, stops, max_new_tokens)
    wanted = [int(t) for t in draft or ()]
    # A sampled draft is checkable only with its seed: a fresh one draws other numbers.
    checked: PrefillResult | None = None
    if _could_end_as(sampling, wanted) and (temperature == 0 or seed is not None):
        checked, accepted, check_seconds = _check_draft(
            engine, cache, prompt_ids, wanted, sampling, block_size
        )
        if accepted:
            return GenerateResult(
                token_ids=tuple(wanted),
                text=engine.decode(wanted),
                finish_reason="stop" if wanted[-1] in stops else "length",
                prefill=checked,
                prefill_seconds=checked.seconds,
                decode_seconds=check_seconds,
                insert_seconds=0.0,
                seed=used_seed,
                draft="accepted",
            )
    pre = prefill(engine, cache, prompt_ids, block_size=block_size)
    generator = sampling.generator(engine)
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
        prefill=checked if checked is not None else pre,
        prefill_seconds=pre.seconds + (checked.seconds if checked is not None else 0.0),
        decode_seconds=decode_seconds,
        insert_seconds=insert_seconds,
        seed=used_seed,
        draft="rejected" if checked is not None else None,
    )


@dataclass(frozen=True, slots=True)
class _Sampling:
    """How each token is chosen, and when generation ends."""

    temperature: float
    top_p: float
    seed: int | None
    stops: set[int]
    max_new_tokens: int

    def generator(self, engine: Engine) -> torch.Generator | None:
        """A fresh generator at the seed: a draft check and decoding draw the same numbers."""
        if self.seed is None:
            return None
        generator = torch.Generator(device=engine.device)
        generator.manual_seed(self.seed)
        return generator


def _could_end_as(sampling: _Sampling, draft: list[int]) -> bool:
    """Whether generation could produce exactly `draft`: no stop inside, ending where it ends."""
    if not draft or len(draft) > sampling.max_new_tokens:
        return False
    if any(token in sampling.stops for token in draft[:-1]):
        return False
    return draft[-1] in sampling.stops or len(draft) == sampling.max_new_tokens


def _check_draft(
    engine: Engine,
    cache: KVCache | None,
    prompt_ids: Sequence[int],
    draft: list[int],
    sampling: _Sampling,
    block_size: int | None,
) -> tuple[PrefillResult, bool, float]:
    """Prefill prompt + draft once; whether each position would choose the draft's token.

    Returns the prefill, the verdict, and the seconds the decisions took.
    """
    pre = prefill(
        engine, cache, [*prompt_ids, *draft], block_size=block_size, logits_from=len(prompt_ids) - 1
    )
    generator = sampling.generator(engine)
    started = time.perf_counter()
    accepted = all(
        _choose(pre.logits[index], sampling.temperature, sampling.top_p, generator) == token
        for index, token in enumerate(draft)
    )
    return pre, accepted, time.perf_counter() - started


def _compute(
    engine: Engine, kv: object, tokens: list[int], start: int, block: int, keep_from: int
) -> torch.Tensor:
    """Run tokens[start:] through the model in canonical padded chunks.

    Returns the logits of positions keep_from.. (one row each, float32).
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
                    rows.append(out.logits[0].float())
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
