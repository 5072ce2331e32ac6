"""The last-position logits of the most recent sequences a cache computed.

Canonical logits are a function of the tokens alone (prefilling.py), so a
prompt that repeats one of them exactly (a fork's calls before it parts, a
retried request) needs no forward at all: its KV is all cached and its
logits are these. They stay in memory only (~200 KB each for the default
model); a sequence whose logits were let go computes its last token again.

Not thread-safe; the caches serialise access.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

LAST_LOGITS = 32


class LastLogits:
    """Logits per token sequence, the `LAST_LOGITS` most recent kept."""

    def __init__(self) -> None:
        self._logits: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()

    def remember(self, tokens: Sequence[int], logits: torch.Tensor) -> None:
        key = tuple(tokens)
        self._logits[key] = logits.detach().clone()
        self._logits.move_to_end(key)
        while len(self._logits) > LAST_LOGITS:
            self._logits.popitem(last=False)

    def get(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """A copy of the logits kept for exactly `tokens`, or None."""
        key = tuple(tokens)
        logits = self._logits.get(key)
        if logits is None:
            return None
        self._logits.move_to_end(key)
        return logits.clone()

    def clear(self) -> None:
        self._logits.clear()
