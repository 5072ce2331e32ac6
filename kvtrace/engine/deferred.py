"""Owed output: decoded tokens whose canonical KV the next prompt's prefill computes.

A generation's decoded tokens have no canonical KV (1-row forwards), and
storing them canonically costs a forward of their own. Instead the cache
remembers prompt + output as owed; the next lookup of a sequence that holds
them right after the cached prompt reports them (`PrefixHit.num_deferred_tokens`),
and prefill computes them in the same forward as that prompt's new tokens.
They count as reused there: the cost was the earlier call's, which a cache
storing its output at once pays in full, so `hit_rate == oracle_hit_rate`
still holds (as long as the working set fits, as for the tiers, and at most
`MAX_DEFERRED` outputs are owed at once, the oldest forgotten first). A
prompt that holds only the start of an owed output settles that part; the
rest stays owed. Owed outputs live in this process only: `generate.settle`
stores them before a process may end.

Not thread-safe; `KVCache` serialises access.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtrace.engine.radix import common_prefix
from kvtrace.errors import UsageError

MAX_DEFERRED = 16


class DeferredOutputs:
    """Sequences whose tail past `done` tokens the cache is owed, oldest first."""

    def __init__(self) -> None:
        self._entries: list[tuple[tuple[int, ...], int]] = []  # (tokens, done)

    def add(self, tokens: Sequence[int], num_canonical: int) -> None:
        """Owe `tokens[num_canonical:]` (nothing when the output is empty)."""
        if not 0 <= num_canonical <= len(tokens):
            raise UsageError("deferred output must follow its cached prompt")
        if num_canonical < len(tokens):
            self._entries.append((tuple(tokens), num_canonical))
            del self._entries[:-MAX_DEFERRED]

    def take(self, tokens: Sequence[int], num_tokens: int, limit: int) -> int:
        """Owed tokens that `tokens` holds right after its hit of `num_tokens` (at most `limit`).

        Only output right after its cached prompt counts (the hit reaches the
        prompt's end): a prompt the tiers lost is a miss, whatever follows it.
        What the sequence holds of an owed output is settled by its prefill,
        which computes and stores every token; the rest stays owed.
        """
        best = 0
        for index, (owed, done) in enumerate(list(self._entries)):
            held = common_prefix(owed, tokens, len(tokens))
            if held <= done:
                continue
            self._entries[index] = (owed, held)
            if num_tokens >= done:
                best = max(best, min(held, limit) - num_tokens)
        self._entries = [(owed, done) for owed, done in self._entries if done < len(owed)]
        return best

    def sequences(self) -> list[tuple[int, ...]]:
        return [owed for owed, _ in self._entries]

    def clear(self) -> None:
        self._entries.clear()
