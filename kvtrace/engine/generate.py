"""Generation on top of the one prefill function: decoding, sampling, drafts.

Decoding runs one token per forward on the DynamicCache that prefill left.
Those rows are not canonical (a 1-row forward does not give the bits of a
padded 64-row chunk), so after generation the output is re-prefilled
canonically on top of the cached prompt (`insert_output=True`): the next
prompt, which contains it, then hits it in full with the bits a cold
computation would give. With `defer_output=True` that re-prefill is not run
here: the cache owes the output (`KVCache.defer`), and the next prompt that
contains it computes it canonically in its own forward, one forward fewer per
call, still counted as reused there. `settle` stores what is still owed.

Checking a draft (replay's verify): when the caller already holds the
response it expects, the recorded one, `generate(..., draft_ids=ids)` runs
prompt + draft through ONE canonical prefill that keeps, for every response
position, the top two logits and the argmax — the way speculative decoding
verifies a draft model's tokens. The draft is the result, with no decoding
loop and no re-prefill, when every argmax is the draft's token by at least
`draft_margin(dtype)` over the runner-up and the draft ends where generation
ends (a stop token, or `max_new_tokens`). Otherwise generation decodes from
the prompt as usual. A rejected draft costs its prefill, and its KV stays
cached: in a replay the next prompt holds the recorded response, so it is
reused there. (Without a cache the fallback computes the prompt again.)

Why the margin: the check's logits come from canonical chunks, decoding's
from 1-row forwards; the two differ in the last bits (measured on the
default model on CPU at ~2,000-token contexts: at most 1.1e-4 on logits up
to ~45 in fp32). A position whose top two logits are closer than the margin
could be ordered differently by decoding, so it rejects the draft and
decoding decides: in practice an accepted draft is what decoding would
produce. Only greedy fp32 generation is checked: a sampled draw has no such
margin, and half precision was not measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import torch

from kvtrace.engine.cache import KVCache
from kvtrace.engine.model import Engine
from kvtrace.engine.prefill import PrefillResult, prefill
from kvtrace.errors import GenerationCancelledError, UsageError


class DraftVerdict(StrEnum):
    """What checking a draft in one prefill decided (see the module docstring)."""

    ACCEPTED = "accepted"  # the draft is the result: no decoding
    REJECTED = "rejected"  # some position was not the draft's token by the margin: decoded

# Smallest gap between the top two fp32 logits for a drafted token to be
# accepted: ~20x the prefill-vs-decode difference measured on the default
# model. Half precision was never measured, so its drafts are not checked.
_DRAFT_MARGINS = {torch.float32: 2e-3}


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """Generated tokens, why generation stopped, and the time spent where.

    `finish_reason` is "stop" (a stop token was produced, and is included in
    `token_ids`) or "length". `seed` is the sampling seed actually used
    (None when greedy). `prefill` is the call's first prefill, whose reuse is
    what the cache held for the prompt: the draft check's when one ran (its
    `kv` released when the draft was rejected). `prefill_seconds` is all
    prefill time, a rejected draft's included; `decode_seconds` includes the
    draft's per-token decisions. `insert_seconds` is the canonical
    re-prefill of the output. `draft` is the verdict on `draft_ids`, or None
    when no draft was checked.
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prefill: PrefillResult
    prefill_seconds: float
    decode_seconds: float
    insert_seconds: float
    seed: int | None
    draft: DraftVerdict | None = None


def draft_margin(dtype: torch.dtype) -> float | None:
    """The top-1/top-2 logit gap below which a drafted token is left to decoding.

    None for dtypes whose prefill-vs-decode difference was never measured:
    their drafts are not checked, decoding decides.
    """
    return _DRAFT_MARGINS.get(dtype)


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
    draft_ids: Sequence[int] | None = None,
    defer_output: bool = False,
    is_cancelled: Callable[[], bool] | None = None,
) -> GenerateResult:
    """Prefill `prompt_ids`, then decode up to `max_new_tokens` tokens.

    Greedy when `temperature == 0`; otherwise temperature + nucleus (`top_p`)
    sampling from a `torch.Generator` seeded with `seed` (a fresh random seed
    when None, returned in the result). Stops after any of `stop_ids`
    (default: the engine's end-of-sequence ids). `draft_ids` is the response
    the caller expects: checked in one prefill first (module docstring) when
    generation is greedy in fp32, the output is to be cached, and the draft could be
    a whole generation (no stop token inside, ending on one or at
    `max_new_tokens`); the result is what decoding gives either way.
    `defer_output` leaves a decoded output owed to the cache instead of
    re-prefilling it (module docstring); it changes no token. `is_cancelled`
    is asked before each decode step: when it says True, generation stops
    with GenerationCancelledError, and the output so far is not cached (the
    prompt, prefilled, stays cached).
    """
    if max_new_tokens < 0:
        raise UsageError("max_new_tokens must be >= 0")
    if temperature < 0 or not 0 < top_p <= 1:
        raise UsageError("temperature must be >= 0 and top_p in (0, 1]")
    if seed is not None and not -(2**63) <= int(seed) < 2**64:
        raise UsageError(f"seed {seed} does not fit a 64-bit generator seed")
    stops = frozenset(engine.eos_token_ids if stop_ids is None else (int(s) for s in stop_ids))
    checked: PrefillResult | None = None
    check_seconds = 0.0
    draft = [int(t) for t in draft_ids or ()]
    if (
        temperature == 0
        and insert_output
        and prompt_ids
        and draft_margin(engine.dtype) is not None
        and _could_end_as(engine, draft, stops, max_new_tokens)
    ):
        checked, accepted, check_seconds = _check_draft(
            engine, cache, prompt_ids, draft, block_size
        )
        if accepted:
            return GenerateResult(
                token_ids=tuple(draft),
                text=engine.decode(draft),
                finish_reason="stop" if draft[-1] in stops else "length",
                prefill=checked,
                prefill_seconds=checked.seconds,
                decode_seconds=check_seconds,
                insert_seconds=0.0,
                seed=None,
                draft=DraftVerdict.ACCEPTED,
            )
        checked = replace(checked, kv=None)  # decoding below builds its own
    pre = prefill(engine, cache, prompt_ids, block_size=block_size)
    used_seed: int | None = None
    generator: torch.Generator | None = None
    if temperature > 0:
        used_seed = int(seed) if seed is not None else int(torch.seed() % (2**63))
        generator = torch.Generator(device=engine.device)
        generator.manual_seed(used_seed)
    started = time.perf_counter()
    out: list[int] = []
    finish = "length"
    logits = pre.logits
    with torch.inference_mode():
        for step in range(max_new_tokens):
            if is_cancelled is not None and is_cancelled():
                raise GenerationCancelledError(f"generation cancelled after {step} tokens")
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
    decode_seconds = time.perf_counter() - started + check_seconds
    insert_seconds = 0.0
    if insert_output and cache is not None and out:
        if defer_output:
            cache.defer([*prompt_ids, *out], len(prompt_ids))
        else:
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
        draft=DraftVerdict.REJECTED if checked is not None else None,
    )


def settle(engine: Engine, cache: KVCache | None) -> None:
    """Store every output the cache is owed (`defer_output`).

    For the end of a session whose next prompt may come from another process
    (or never): what a later process will find on disk.
    """
    if cache is not None:
        for tokens in cache.owed():
            prefill(engine, cache, tokens)


def _could_end_as(engine: Engine, draft: list[int], stops: frozenset[int], limit: int) -> bool:
    """Whether generation could produce exactly `draft`: valid ids, ending where it ends."""
    if not draft or len(draft) > limit:
        return False
    if min(draft) < 0 or max(draft) >= engine.vocab_size:
        return False  # not this model's tokens: decoding decides (and differs)
    if any(token in stops for token in draft[:-1]):
        return False
    return draft[-1] in stops or len(draft) == limit


def _check_draft(
    engine: Engine,
    cache: KVCache | None,
    prompt_ids: Sequence[int],
    draft: list[int],
    block_size: int | None,
) -> tuple[PrefillResult, bool, float]:
    """Prefill prompt + draft once; whether greedy decoding would choose every draft token.

    Returns the prefill (its logits: per response position, argmax and top
    two values), the verdict, and the seconds the decisions took.
    """
    pre = prefill(
        engine,
        cache,
        [*prompt_ids, *draft],
        block_size=block_size,
        logits_from=len(prompt_ids) - 1,
        reduce_logits=_top_two,
    )
    started = time.perf_counter()
    best, first, second = pre.logits[: len(draft)].cpu().unbind(dim=1)
    margin = draft_margin(engine.dtype) or 0.0
    wanted = torch.tensor(draft, dtype=best.dtype)
    accepted = bool(torch.all((best == wanted) & (first - second >= margin)))
    return pre, accepted, time.perf_counter() - started


def _top_two(rows: torch.Tensor) -> torch.Tensor:
    """Per row: [argmax, top logit, runner-up logit] (ids below 2**24 are exact in fp32)."""
    values, indices = torch.topk(rows, 2, dim=-1)
    return torch.stack([indices[:, 0].float(), values[:, 0], values[:, 1]], dim=1)


def _choose(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    if temperature == 0 or generator is None:
        return int(torch.argmax(logits).item())
    # In float64 (1e-300 is 0 in float32) and shifted so the top logit is 0: a temperature
    # near 0 then sends the others to -inf, not inf - inf = NaN (greedy, as in the limit).
    shifted = logits.double() - logits.max().double()
    probs = torch.softmax(shifted / temperature, dim=-1).to(logits.dtype)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        keep[..., 0] = True  # the top token always (a top_p of 1e-300 is 0 in float32)
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
