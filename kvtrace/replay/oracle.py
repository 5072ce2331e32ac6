"""The oracle bound: the best any exact-prefix KV cache could do on a replay.

For each model call, the oracle is the longest prefix its prompt's token ids
share with ANY sequence the cache could have seen before it (earlier prompts
and earlier prompt+output sequences, including a recorded output that verify
checked as a draft), capped at ``len(prompt) - 1`` because
the prompt's last token is always computed (its logits give the next token).

The structure is a sorted list of token sequences. Among a set of sequences,
the one sharing the longest prefix with a query is always one of the query's
two lexicographic neighbours (anything further away in sorted order shares a
prefix no longer than the nearer neighbour does), so a lookup is one bisect
plus two linear prefix comparisons: O(len · log n) instead of comparing
against every earlier sequence. Only sequences that are not already a prefix
of a stored one add information, but storing them all keeps the code simple
and the cost is a list insert per call (a run has tens to thousands of calls).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


def common_prefix_length(a: Sequence[object], b: Sequence[object]) -> int:
    """Number of leading items (tokens, or characters of strings) `a` and `b` share."""
    limit = min(len(a), len(b))
    # Compare big slices first: list equality runs in C, far faster than a loop.
    low, step = 0, 256
    while low + step <= limit and a[low : low + step] == b[low : low + step]:
        low += step
    while low < limit and a[low] == b[low]:
        low += 1
    return low


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest prefix a query shares with a seen sequence, and which one."""

    length: int
    source: str | None  # the label given when the sequence was added; None if nothing shared


class PrefixOracle:
    """Every token sequence a cache could have seen so far, for longest-prefix queries."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, ...]] = []
        self._labels: list[str] = []

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, token_ids: Sequence[int], label: str = "") -> None:
        """Record that a cache could now hold `token_ids` (and so all its prefixes)."""
        key = tuple(token_ids)
        if not key:
            return
        index = bisect.bisect_left(self._keys, key)
        if index < len(self._keys) and self._keys[index] == key:
            return
        self._keys.insert(index, key)
        self._labels.insert(index, label)

    def longest_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest prefix of `token_ids` shared with any sequence added so far."""
        key = tuple(token_ids)
        index = bisect.bisect_left(self._keys, key)
        best = PrefixMatch(0, None)
        for neighbour in (index - 1, index):
            if 0 <= neighbour < len(self._keys):
                length = common_prefix_length(key, self._keys[neighbour])
                if length > best.length:
                    best = PrefixMatch(length, self._labels[neighbour])
        return best

    def bound(self, prompt_ids: Sequence[int]) -> int:
        """The oracle bound of a prompt: shared prefix capped at ``len - 1``."""
        if not prompt_ids:
            return 0
        return min(self.longest_prefix(prompt_ids).length, len(prompt_ids) - 1)
