"""Prefill for models with window or state layers: block-aligned chunks, a state per block.

The counterpart of prefilling.py's canonical chunks for the models the radix
tree cannot serve (layers.py, statecache.py). Every forward is one chunk
`[j·B, (j+1)·B)` at absolute block offsets (the last one shorter, never
padded: padding would run through a recurrent state), so the forwards after
a resume point are the very forwards a cold run makes from there; the cache
restores the state that cold run had at that point (modelstate.py). A hit
and a cold run thus give the same bits, with no numeric assumption about
row counts or attention reductions. At each boundary passed, the state is
snapshotted and stored.

`ModelLayout.steps_one_token` models run their first block as one forward
and every later token alone, on both paths.

The result's `kv` is the sequence's `ModelState`, which decode.py steps one
token per forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtrace.engine.model import Engine
from kvtrace.engine.modelstate import BlockState, ModelState
from kvtrace.engine.statecache import StateCache, StateHit
from kvtrace.errors import CacheError


def prefill_states(
    engine: Engine,
    cache: StateCache | None,
    tokens: list[int],
    *,
    block_size: int,
    keep_from: int,
    plain: bool,
    reduce_logits: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, ModelState, StateHit | None]:
    """Compute (or resume) `tokens`; logits of positions `keep_from ..` (one row each).

    `plain`: only the last position's logits are asked for, so an exact repeat
    whose logits the cache kept computes nothing when its blocks cover it all.
    Returns the logits, the sequence's state (for decoding) and the hit.
    """
    known = cache.last_logits(tokens) if cache is not None and plain else None
    limit = len(tokens) if known is not None else keep_from
    hit = cache.lookup(tokens, max_tokens=limit) if cache is not None else None
    layout = engine.layout
    reused = hit.num_tokens if hit is not None else 0
    state = ModelState.restore(engine.model, hit.blocks if hit is not None else (), reused,
                               uses_state_list=layout.uses_state_list)
    if known is not None and reused == len(tokens):
        return known.unsqueeze(0), state, hit
    rows: list[torch.Tensor] = []
    snapshots: list[tuple[int, BlockState]] = []
    n, b, pos = len(tokens), block_size, reused
    device = engine.device
    try:
        with torch.inference_mode():
            while pos < n:
                end = min(n, (pos // b + 1) * b)
                step = 1 if layout.steps_one_token and pos >= b else end - pos
                for lo in range(pos, end, step):
                    hi = min(end, lo + step)
                    ids = torch.tensor([tokens[lo:hi]], dtype=torch.long, device=device)
                    keep = hi - max(keep_from, lo) if hi > keep_from else 0
                    logits = state.forward(engine.model, ids, start=lo, keep=keep)
                    if keep:
                        kept = logits.float()
                        rows.append(reduce_logits(kept) if reduce_logits is not None else kept)
                if end % b == 0:
                    snapshots.append((end, state.snapshot(end - b, end)))
                pos = end
    except RuntimeError as exc:  # torch errors: out of memory, bad ids …
        raise CacheError(f"the model failed during prefill: {exc}") from exc
    if not rows:
        raise CacheError("prefill computed no token (the cache covered the whole sequence)")
    if cache is not None:
        cache.store(tokens, snapshots)
        if plain:
            cache.remember_logits(tokens, rows[-1][-1])
    return (torch.cat(rows) if len(rows) > 1 else rows[0]), state, hit
