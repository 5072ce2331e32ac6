"""Per-layer KV in buffers with room to grow, written in place.

Why not transformers' `DynamicLayer`: it grows by `torch.cat`, so every call
of an agent run allocates each layer's whole KV anew, a few rows longer than
the last, copies it, and frees the old. A `GrowingLayer` writes new rows
into spare capacity of its buffer and reallocates only when that runs out,
by 256 rows or a sixteenth more at least (a dozen times over a 5k-token
run). Decoding appends in place as well.

Sharing without copies: each of the cache's live sequences (cache.py) keeps
its layers' buffers; the memory tree borrows the rows of that sequence from them
instead of copying (radix.py, `Loan`), and the next prefill that extends it
takes them over (`adopt`), writing after the reused rows in place. So an
agent run's growing prompt exists once in memory, not twice. Rules that
keep every reader right:

- only one layer owns a buffer (may write into it) at a time;
- nobody writes below `frozen`, the rows the tree may borrow: a layer that
  would (not the owner, or cropped below them) first copies its rows into
  a buffer of its own;
- an owner that runs out of room swaps in bigger tensors inside the same
  `KVBuffer`, so borrowed rows follow the move (read them through the
  buffer, `buffer_rows`, never through a view kept from before);
- a layer whose rows a later owner has overwritten (an earlier prefill's
  result, used after a later prefill on the same cache took the buffer
  over) raises `CacheError` instead of computing on KV not its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvtrace.engine.radix import KVSource
from kvtrace.errors import CacheError

MIN_SPARE_ROWS = 256
_SERIALS = itertools.count(1)
ROW_ALIGN = 64
# A prefill's buffers past this many rows hold whole blocks of torch's flash kernel's 512 keys
# (attention.py's FLASH_BLOCK), so its attention reads a layer's keys padded to whole blocks in
# place (`padded`). Shorter ones keep 64-row capacities (their spare rows mostly cover the
# padding anyway, and the copy is cheap there): blocks would cost a 300-row prompt 78 % more.
FLASH_ALIGN, FLASH_ALIGN_FROM = 512, 1024


class KVBuffer:
    """One layer's keys and values `[1, kv_heads, capacity, head_dim]`, and who may write where."""

    __slots__ = ("cuts", "frozen", "keys", "owner", "values")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys
        self.values = values
        # The owning layer's serial, not the layer: a reference back would make
        # a cycle, and megabytes of KV would wait for the cyclic collector.
        self.owner = 0
        self.cuts: list[int] = []  # the row from which each new owner writes, in order
        self.frozen = 0  # rows below this are read by others (the cache): never overwritten

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `update` writes in place into a buffer with spare rows.

    One sequence (no batch, no beams). `keys`/`values` are views of the
    buffer: read them before the next prefill on the same cache, which may
    take the buffer over and write past the rows it reuses (`update` and
    `crop` check; a plain read cannot).
    """

    def __init__(self) -> None:
        super().__init__()
        self._serial = next(_SERIALS)
        self._buffer: KVBuffer | None = None
        self._length = 0
        self._epoch = 0  # how many of the buffer's cuts this layer's rows have survived

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_intact()
        end = self._length + key_states.shape[2]
        # Inside inference mode whoever calls: the buffers are inference tensors
        # (made in prefill's), which may only be written there.
        with torch.inference_mode():
            buffer = self._buffer
            if buffer is None or buffer.owner != self._serial or self._length < buffer.frozen:
                buffer = self._detach(end, like=key_states)
            elif end > buffer.capacity:
                self._grow(buffer, end)
            buffer.keys[:, :, self._length : end].copy_(key_states)
            buffer.values[:, :, self._length : end].copy_(value_states)
        return self._set_length(end)

    def padded(self, multiple: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values of the rows up to the next multiple of `multiple`, in place; None
        when the buffer does not hold that many rows.

        Why: prefill attention (attention.py's `flash_attention`) reads the keys zero-padded
        to whole blocks, and copying each layer's whole KV into padded scratch took ~8 % of an agent
        rebuild (docs/benchmarks.md). The rows past the length are zeros from `_allocate`,
        or keys and values the model wrote before a crop, an adoption or a detach (no
        writer leaves anything else there): finite and of a real key's size, so a masked
        score stays -inf and weighs an exact zero, which is all the kernel asks of them.
        """
        buffer = self._buffer
        if buffer is None:
            return None
        rows = -(-self._length // multiple) * multiple
        if rows > buffer.capacity:
            return None
        return buffer.keys[:, :, :rows], buffer.values[:, :, :rows]

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` rows (their space is written next)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of rows to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._check_intact()
        length = max(0, self._length + tokens_to_remove)
        buffer = self._buffer
        owns = buffer is not None and buffer.owner == self._serial
        if buffer is not None and owns and buffer.cuts and length < buffer.cuts[-1]:
            buffer.cuts.append(length)  # below where it took over: rows others may hold
            self._epoch = len(buffer.cuts)
        self._set_length(length)

    def reset(self) -> None:
        self._buffer = None
        self._length = 0
        super().reset()

    @property
    def buffer(self) -> KVBuffer | None:
        """The buffer this layer's rows are in (None before the first write)."""
        return self._buffer

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise CacheError("kvtrace's KV layers hold one sequence: no beams")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise CacheError("kvtrace's KV layers hold one sequence: no batches")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise CacheError("kvtrace's KV layers hold one sequence: no batches")

    def seed(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start from the rows of `pieces` (each `[1, kv_heads, n, head_dim]`), copied once."""
        keys = [k for k, _ in pieces]
        if not keys:
            return
        self.lazy_initialization(keys[0], pieces[0][1])
        total = sum(int(k.shape[2]) for k in keys)
        buffer = self._own(self._allocate(total, like=keys[0]))
        row = 0
        for k, v in pieces:
            n = int(k.shape[2])
            buffer.keys[:, :, row : row + n].copy_(k)
            buffer.values[:, :, row : row + n].copy_(v)
            row += n
        self._set_length(total)

    def adopt(self, buffer: KVBuffer, length: int) -> None:
        """Start from the first `length` rows of `buffer`, taking it over (no copy).

        From here on this layer writes after row `length`: the caller vouches
        that nobody borrows rows past it any more (`frozen` drops to it).
        Earlier layers on the buffer find out, should they be used again,
        whether those writes reached their rows.
        """
        if length > buffer.frozen:
            raise CacheError("cannot adopt KV rows the buffer does not keep")
        self.lazy_initialization(buffer.keys, buffer.values)
        buffer.cuts.append(length)
        buffer.owner = self._serial
        buffer.frozen = length
        self._buffer = buffer
        self._epoch = len(buffer.cuts)
        self._set_length(length)

    def freeze(self, length: int) -> KVBuffer:
        """Keep the first `length` rows as they are (the cache borrows them); return the buffer."""
        buffer = self._buffer
        if buffer is None or buffer.owner != self._serial or length > self._length:
            raise CacheError("only the owner of KV rows can keep them")
        buffer.frozen = length
        return buffer

    def detach(self) -> None:
        """Copy this layer's rows into a buffer of its own, leaving the old one to others.

        For a sequence that keeps decoding while the cache's next prefill may
        take its buffer over (batch.py): that prefill then writes where this
        layer no longer reads.
        """
        if self._buffer is None or not self._length:
            return
        self._check_intact()
        with torch.inference_mode():
            # A decoding sequence's own: decode steps append to it, no prefill reads it padded.
            self._detach(self._length, like=self._buffer.keys, flash_blocks=False)
        self._set_length(self._length)

    def _detach(self, rows: int, *, like: torch.Tensor, flash_blocks: bool = True) -> KVBuffer:
        """A buffer of this layer's own with room for `rows`, its current rows copied in."""
        old = self._buffer
        buffer = self._own(self._allocate(rows, like=like, flash_blocks=flash_blocks))
        if old is not None and self._length:
            buffer.keys[:, :, : self._length].copy_(old.keys[:, :, : self._length])
            buffer.values[:, :, : self._length].copy_(old.values[:, :, : self._length])
        return buffer

    def _grow(self, buffer: KVBuffer, rows: int) -> None:
        """Bigger tensors for the same buffer (so rows borrowed from it follow), rows copied."""
        bigger = self._allocate(rows, like=buffer.keys)
        n = self._length
        bigger.keys[:, :, :n].copy_(buffer.keys[:, :, :n])
        bigger.values[:, :, :n].copy_(buffer.values[:, :, :n])
        buffer.keys, buffer.values = bigger.keys, bigger.values

    @staticmethod
    def _allocate(rows: int, *, like: torch.Tensor, flash_blocks: bool = True) -> KVBuffer:
        """A new buffer with room for `rows`, which the caller writes at once, and spare rows
        after, zeros (`padded` reads them); in whole flash blocks past `FLASH_ALIGN_FROM`
        rows unless `flash_blocks` is False."""
        spare = max(MIN_SPARE_ROWS, rows // 16)
        align = FLASH_ALIGN if flash_blocks and rows + spare > FLASH_ALIGN_FROM else ROW_ALIGN
        capacity = -(-(rows + spare) // align) * align
        shape = (like.shape[0], like.shape[1], capacity, like.shape[3])
        keys = torch.empty(shape, dtype=like.dtype, device=like.device)
        values = torch.empty(shape, dtype=like.dtype, device=like.device)
        keys[:, :, rows:] = 0
        values[:, :, rows:] = 0
        return KVBuffer(keys, values)

    def _own(self, buffer: KVBuffer) -> KVBuffer:
        buffer.owner = self._serial
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
        if buffer is None or buffer.owner == self._serial:
            return
        later = buffer.cuts[self._epoch :]
        if later and min(later) < self._length:
            raise CacheError(
                "this KV was overwritten by a later prefill on the same cache; prefill again"
            )


def growing_cache(config: object) -> DynamicCache:
    """An empty transformers `DynamicCache` for `config` whose layers are `GrowingLayer`s."""
    kv = DynamicCache(config=config)  # type: ignore[arg-type]
    layers = kv.layers
    for i, layer in enumerate(layers):
        if type(layer) is not DynamicLayer:  # sliding windows and the like: not ours to grow
            raise CacheError(f"unsupported KV layer type {type(layer).__name__}")
        layers[i] = GrowingLayer()
    return kv


def growing_layers(kv: DynamicCache) -> list[GrowingLayer]:
    """The layers of a `growing_cache`, typed as such."""
    layers = [layer for layer in kv.layers if isinstance(layer, GrowingLayer)]
    if len(layers) != len(kv.layers):
        raise CacheError("this DynamicCache was not made by growing_cache")
    return layers


def buffer_rows(buffers: Sequence[KVBuffer]) -> KVSource:
    """A KVSource over per-layer buffers: stacked copies of rows [start, end).

    Reads through each buffer, so it stays right when an owner grows one.
    """

    def source(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.stack([buffer.keys[0, :, start:end] for buffer in buffers])
        values = torch.stack([buffer.values[0, :, start:end] for buffer in buffers])
        return keys, values

    return source
