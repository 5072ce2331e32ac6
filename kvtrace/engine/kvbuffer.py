"""Per-layer KV in buffers with room to grow, written in place.

Why not transformers' `DynamicLayer`: it grows by `torch.cat`, so every call
of an agent run allocates each layer's whole KV anew, a few rows longer than
the last, and frees the old. glibc's allocator rarely fits the next, larger
block into the freed ones: on a 30-call, 5k-token replay the process grew by
about 1.6x the KV it actually held (docs/benchmarks.md). A `GrowingLayer`
writes new rows into spare capacity of its buffer and reallocates only when
that runs out, by an eighth more at least (a few dozen times over a run).

Sharing without copies: the cache's live sequence (cache.py) hands its
layers' buffers to the next prefill (`adopt`), which writes from the reused
length on, in place. Only one layer owns a buffer's tail at a time; a layer
that is not the owner copies its rows into a buffer of its own before it
writes. A layer whose rows the owner has since overwritten (an earlier
prefill's result, used after a later prefill on the same cache took the
buffer over) raises `CacheError` instead of computing on KV not its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicLayer

from kvtrace.errors import CacheError

MIN_SPARE_ROWS = 256
ROW_ALIGN = 64


class _Buffer:
    """Keys and values `[1, kv_heads, capacity, head_dim]`, and who may write past whom."""

    __slots__ = ("cuts", "keys", "owner", "values")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys
        self.values = values
        self.owner: GrowingLayer | None = None
        self.cuts: list[int] = []  # the row from which each new owner writes, in order

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `update` writes in place into a buffer with spare rows."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer: _Buffer | None = None
        self._length = 0
        self._epoch = 0  # how many of the buffer's cuts this layer's rows have survived

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_intact()
        end = self._length + key_states.shape[2]
        buffer = self._buffer
        if buffer is None or buffer.owner is not self or end > buffer.capacity:
            buffer = self._move(end, like=key_states)
        buffer.keys[:, :, self._length : end].copy_(key_states)
        buffer.values[:, :, self._length : end].copy_(value_states)
        return self._set_length(end)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` rows (their space is written next)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of rows to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._check_intact()
        length = max(0, self._length + tokens_to_remove)
        buffer = self._buffer
        if buffer is not None and buffer.owner is self and buffer.cuts and length < buffer.cuts[-1]:
            buffer.cuts.append(length)  # below where it took over: rows others may hold
            self._epoch = len(buffer.cuts)
        self._set_length(length)

    def reset(self) -> None:
        self._buffer = None
        self._length = 0
        super().reset()

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def seed(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start from the rows of `pieces` (each `[1, kv_heads, n, head_dim]`), copied once."""
        keys = [k for k, _ in pieces]
        if not keys:
            return
        self.lazy_initialization(keys[0], pieces[0][1])
        total = sum(int(k.shape[2]) for k in keys)
        buffer = self._allocate(total, like=keys[0])
        row = 0
        for k, v in pieces:
            n = int(k.shape[2])
            buffer.keys[:, :, row : row + n].copy_(k)
            buffer.values[:, :, row : row + n].copy_(v)
            row += n
        self._set_length(total)

    def adopt(self, other: GrowingLayer, length: int) -> None:
        """Start from `other`'s first `length` rows, taking its buffer over (no copy).

        From here on this layer writes after row `length`; `other`, should it
        be used again, finds out whether those writes reached its rows.
        """
        other._check_intact()
        buffer = other._buffer
        if buffer is None or length > other._length:
            raise CacheError("cannot adopt KV rows a layer does not hold")
        self.lazy_initialization(buffer.keys, buffer.values)
        buffer.cuts.append(length)
        buffer.owner = self
        self._buffer = buffer
        self._epoch = len(buffer.cuts)
        self._set_length(length)

    def _move(self, rows: int, *, like: torch.Tensor) -> _Buffer:
        """A buffer of this layer's own with room for `rows`, its current rows copied in."""
        old = self._buffer
        buffer = self._allocate(rows, like=like)
        if old is not None and self._length:
            buffer.keys[:, :, : self._length].copy_(old.keys[:, :, : self._length])
            buffer.values[:, :, : self._length].copy_(old.values[:, :, : self._length])
        return buffer

    def _allocate(self, rows: int, *, like: torch.Tensor) -> _Buffer:
        spare = max(MIN_SPARE_ROWS, rows // 16)
        capacity = -(-(rows + spare) // ROW_ALIGN) * ROW_ALIGN
        shape = (like.shape[0], like.shape[1], capacity, like.shape[3])
        buffer = _Buffer(
            torch.empty(shape, dtype=like.dtype, device=like.device),
            torch.empty(shape, dtype=like.dtype, device=like.device),
        )
        buffer.owner = self
        self._buffer = buffer
        self._epoch = 0
        return buffer

    def _set_length(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Point `keys` and `values` (what transformers reads) at the first `length` rows."""
        buffer = self._buffer
        if buffer is None:
            raise CacheError("KV layer has no buffer")
        self._length = length
        keys, values = buffer.keys[:, :, :length], buffer.values[:, :, :length]
        self.keys, self.values = keys, values
        return keys, values

    def _check_intact(self) -> None:
        buffer = self._buffer
        if buffer is None or buffer.owner is self:
            return
        later = buffer.cuts[self._epoch :]
        if later and min(later) < self._length:
            raise CacheError(
                "this KV was overwritten by a later prefill on the same cache; prefill again"
            )


def growing_cache(config: object) -> object:
    """An empty transformers `DynamicCache` for `config` whose layers are `GrowingLayer`s."""
    from transformers import DynamicCache

    kv = DynamicCache(config=config)  # type: ignore[arg-type]
    layers = kv.layers
    for i, layer in enumerate(layers):
        if type(layer) is not DynamicLayer:  # sliding windows and the like: not ours to grow
            raise CacheError(f"unsupported KV layer type {type(layer).__name__}")
        layers[i] = GrowingLayer()
    return kv
