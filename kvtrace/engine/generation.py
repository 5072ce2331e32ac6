"""Generation on top of the one prefill function: decoding, sampling, drafts.

Decoding runs one token per forward on the DynamicCache that prefill left:
a 1-row forward for a lone generation, or, in a `DecodeBatcher` (batch.py),
a padded forward (a multiple of 4, 8 or 16 rows, decode.py) that may
decode other sequences too, whose tokens and logits are the same whatever
else the batcher decodes (`padded_decode=True` runs that step alone). Where
the probe finds only 16 rows safe, the padded step costs a lone sequence
~30-40 % more per token (docs/benchmarks.md, "Batched decoding"), so it is
used only where requests are batched. Those
rows are not canonical (one query row's
attention is not the tiled attention of a prefill chunk), so after
generation the output is re-prefilled
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
from decode steps; the two differ in the last bits (measured on the
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
from typing import Any

import torch

from kvtrace.engine.decode import Decoding, decode_step
from kvtrace.engine.model import Engine
from kvtrace.engine.prefilling import PrefillResult, prefill
from kvtrace.engine.sampling import SamplingParams
from kvtrace.engine.statecache import PrefixCache
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


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    """How one generation runs: `generate`'s keywords as one value, which `begin` and the
    batcher take (arguments as `generate`'s)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: Iterable[int] | None = None
    insert_output: bool = True
    block_size: int | None = None
    draft_ids: Sequence[int] | None = None
    defer_output: bool = False
    is_cancelled: Callable[[], bool] | None = None

    @classmethod
    def sampled(cls, params: SamplingParams, **rest: Any) -> GenerateOptions:
        """The options of a generation sampled as `params` say (`rest`: the other fields)."""
        return cls(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                   top_p=params.top_p, seed=params.seed, **rest)


def draft_margin(dtype: torch.dtype) -> float | None:
    """The top-1/top-2 logit gap below which a drafted token is left to decoding.

    None for dtypes whose prefill-vs-decode difference was never measured:
    their drafts are not checked, decoding decides.
    """
    return _DRAFT_MARGINS.get(dtype)


def generate(
    engine: Engine,
    cache: PrefixCache | None,
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
    padded_decode: bool = False,
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
    prompt, prefilled, stays cached). Decoding runs 1-row forwards; with
    `padded_decode` it runs the padded step a `DecodeBatcher` runs
    (decode.py), so the tokens and logits equal that batcher's, whatever else
    it decodes alongside.
    """
    options = GenerateOptions(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
        stop_ids=stop_ids, insert_output=insert_output, block_size=block_size,
        draft_ids=draft_ids, defer_output=defer_output, is_cancelled=is_cancelled)
    return generate_with(engine, cache, prompt_ids, options, padded_decode=padded_decode)


def generate_with(engine: Engine, cache: PrefixCache | None, prompt_ids: Sequence[int],
                  options: GenerateOptions, *, padded_decode: bool = False) -> GenerateResult:
    """`generate` with its options as one value (what a caller that holds them passes on)."""
    begun = begin(engine, cache, prompt_ids, options)
    if isinstance(begun, GenerateResult):
        return begun
    while not begun.advance():
        decode_step(engine, [begun.decoding], padded=padded_decode)
    return begun.finish()


def begin(engine: Engine, cache: PrefixCache | None, prompt_ids: Sequence[int],
          options: GenerateOptions) -> GenerateResult | Generation:
    """`generate` up to its first decode step: the result (an accepted draft), or the
    generation to step (`advance`, `decode_step`, `finish`), alone or in a batch (batch.py).
    """
    max_new_tokens, temperature, top_p = options.max_new_tokens, options.temperature, options.top_p
    seed, stop_ids, block_size = options.seed, options.stop_ids, options.block_size
    insert_output, draft_ids = options.insert_output, options.draft_ids
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
    # A generation of one token reads the prompt's logits only: an exact repeat then
    # needs no KV (prefill's `need_kv`).
    pre = prefill(engine, cache, prompt_ids, block_size=block_size,
                  need_kv=max_new_tokens > 1)
    used_seed: int | None = None
    generator: torch.Generator | None = None
    if temperature > 0:
        used_seed = int(seed) if seed is not None else int(torch.seed() % (2**63))
        generator = torch.Generator(device=engine.device)
        generator.manual_seed(used_seed)
    decoding = Decoding(
        pre.kv, pre.logits, temperature=temperature, top_p=top_p, generator=generator,
        prompt_ids=prompt_ids,
    )
    return Generation(
        engine,
        cache,
        [int(t) for t in prompt_ids],
        decoding,
        pre=pre,
        checked=checked,
        check_seconds=check_seconds,
        seed=used_seed,
        stops=stops,
        max_new_tokens=max_new_tokens,
        insert_output=insert_output,
        defer_output=options.defer_output,
        is_cancelled=options.is_cancelled,
    )


class Generation:
    """A prefilled generation between its decode steps (`begin`).

    `advance` chooses the next token (or says the generation is over),
    `decode_step(engine, [g.decoding, ...])` computes the logits after it,
    `finish` stores the output as `generate` does and returns the result.
    """

    __slots__ = (
        "cache", "check_seconds", "checked", "decoding", "defer_output", "engine",
        "finish_reason", "insert_output", "is_cancelled", "max_new_tokens", "pre",
        "prompt_ids", "seed", "started", "stops",
    )

    def __init__(
        self,
        engine: Engine,
        cache: PrefixCache | None,
        prompt_ids: list[int],
        decoding: Decoding,
        *,
        pre: PrefillResult,
        checked: PrefillResult | None,
        check_seconds: float,
        seed: int | None,
        stops: frozenset[int],
        max_new_tokens: int,
        insert_output: bool,
        defer_output: bool,
        is_cancelled: Callable[[], bool] | None,
    ) -> None:
        self.engine = engine
        self.cache = cache
        self.prompt_ids = prompt_ids
        self.decoding = decoding
        self.pre = pre
        self.checked = checked
        self.check_seconds = check_seconds
        self.seed = seed
        self.stops = stops
        self.max_new_tokens = max_new_tokens
        self.insert_output = insert_output
        self.defer_output = defer_output
        self.is_cancelled = is_cancelled
        self.finish_reason = "length"
        self.started = time.perf_counter()

    def advance(self) -> bool:
        """Choose the next token; True when generation is over (it needs no decode step).

        Raises GenerationCancelledError when `is_cancelled` says so.
        """
        out = self.decoding.tokens
        if len(out) == self.max_new_tokens:
            return True
        if self.is_cancelled is not None and self.is_cancelled():
            raise GenerationCancelledError(f"generation cancelled after {len(out)} tokens")
        with torch.inference_mode():
            token = self.decoding.choose()
        if token in self.stops:
            self.finish_reason = "stop"
            return True
        return len(out) == self.max_new_tokens

    def finish(self) -> GenerateResult:
        """Store the output (now, or owed: `defer_output`) and return the result."""
        engine, cache, out = self.engine, self.cache, self.decoding.tokens
        decode_seconds = time.perf_counter() - self.started + self.check_seconds
        insert_seconds = 0.0
        if self.insert_output and cache is not None and out:
            if self.defer_output:
                cache.defer([*self.prompt_ids, *out], len(self.prompt_ids))
            else:
                # Store prompt + output canonically: the prompt is cached (it was
                # just prefilled), so only the output tokens are computed.
                insert_seconds = prefill(engine, cache, [*self.prompt_ids, *out]).seconds
        checked, pre = self.checked, self.pre
        return GenerateResult(
            token_ids=tuple(out),
            text=engine.decode(out),
            finish_reason=self.finish_reason,
            prefill=checked if checked is not None else pre,
            prefill_seconds=pre.seconds + (checked.seconds if checked is not None else 0.0),
            decode_seconds=decode_seconds,
            insert_seconds=insert_seconds,
            seed=self.seed,
            draft=DraftVerdict.REJECTED if checked is not None else None,
        )


def settle(engine: Engine, cache: PrefixCache | None) -> None:
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
    cache: PrefixCache | None,
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
