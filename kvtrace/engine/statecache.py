"""The prefix cache of a model with window or state layers: block states, memory and disk.

A model whose every layer attends to the whole context keeps its KV in the
radix tree (cache.py) and resumes at any token. A model with sliding-window
or recurrent layers (layers.py) cannot: a recurrent layer resumes only where
a snapshot of its state was taken, and a window layer needs the last W rows
before the point. So this cache keeps, at every block boundary (every
`block_size` tokens, 64 by default) that prefill passes, a `BlockState`
(modelstate.py): the block's own K/V rows for attention layers and a copy of
every recurrent and convolution state at its end. A hit is the longest
prefix that ends at a boundary whose blocks are all cached (the model's
resume points): `lookup` walks the chain from the root.

Blocks are keyed as the disk tier keys KV blocks (disk.py): a chain hash
seeded with the engine fingerprint, and every read compares the block's
token ids. Memory: an LRU of blocks under a byte budget; a lookup touches a
hit's blocks deepest first, so a prefix's ancestors are always fresher than
its tail and eviction takes tails first (a block whose ancestor was evicted
could never be reached). Disk: one safetensors file per block
(`BlockStore.write_state`), written inline, verified on read, found again
after a restart; `disk_bytes` bounds the folder as for KV blocks.

Fidelity, by construction (statecache's `prefill_states`): every forward is
one block-aligned chunk, on the cold path and after a hit alike, so a
resumed prompt runs exactly the forwards a cold one runs from the same
boundary, on the same cached tensors: the same bits, at any dtype, with any
attention implementation. A model whose multi-token forward forgets its
state (`ModelLayout.steps_one_token`) runs one token per forward after its
first block, on both paths.

Sizes: a full layer's rows cost what they cost in the radix tree; a window
layer keeps at most `window - 1` rows per block (what it can still read);
state layers one snapshot per block, constant in the context length.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtrace.engine.cache import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MEMORY_BYTES,
    KVCache,
    TierStats,
    check_block_size,
)
from kvtrace.engine.disk import BlockStore, chain_keys
from kvtrace.engine.faults import DiskFaults
from kvtrace.engine.lastlogits import LastLogits
from kvtrace.engine.model import Engine
from kvtrace.engine.modelstate import BlockState
from kvtrace.engine.owed import OwedOutputs
from kvtrace.errors import BlockWriteError, UsageError


@dataclass(frozen=True, slots=True)
class StateHit:
    """The blocks of the longest cached prefix that ends at a block boundary."""

    num_tokens: int
    num_memory_tokens: int
    num_disk_tokens: int
    blocks: tuple[BlockState, ...]
    num_deferred_tokens: int = 0


@dataclass(slots=True)
class _Entry:
    tokens: tuple[int, ...]
    state: BlockState


class StateCache:
    """Block states of one engine in memory and, with `disk_dir`, on disk (module docstring).

    Its surface is `KVCache`'s where callers share it (logits, owed output,
    stats, faults); `prefill` chooses the path by the cache it is given.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        disk_dir: str | os.PathLike[str] | None = None,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        disk_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        write_behind: bool = False,  # accepted for KVCache's signature; states write inline
    ) -> None:
        check_block_size(block_size)
        if memory_bytes < 0 or (disk_bytes is not None and disk_bytes < 0):
            raise UsageError("cache budgets must be >= 0 bytes")
        self.engine = engine
        self.fingerprint = engine.fingerprint
        self.block_size = block_size
        self.max_memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes
        self.disk = BlockStore(disk_dir, block_size=block_size) if disk_dir is not None else None
        self._blocks: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._num_bytes = 0
        self._written = 0  # disk bytes written since the last budget check
        self._logits = LastLogits()
        self._owed = OwedOutputs()
        self._lock = threading.RLock()

    # -- lookup and store --------------------------------------------------------

    def lookup(self, tokens: Sequence[int], *, max_tokens: int | None = None) -> StateHit:
        """The longest prefix of `tokens` (at most `max_tokens`) ending at a cached boundary."""
        limit = len(tokens) if max_tokens is None else max(0, min(max_tokens, len(tokens)))
        b = self.block_size
        keys = self._chain(tokens[: limit - limit % b])
        found: list[BlockState] = []
        num_memory = 0
        with self._lock:
            for j, key in enumerate(keys):
                block = tuple(tokens[j * b : (j + 1) * b])
                entry = self._blocks.get(key)
                if entry is not None and entry.tokens == block:
                    found.append(entry.state)
                    num_memory += b
                    continue
                state = self._read_disk(key, block)
                if state is None:
                    break
                found.append(state)
                self._keep(key, block, state)  # promoted into memory
            for key in reversed(keys[: len(found)]):  # deepest first: ancestors stay fresher
                if key in self._blocks:
                    self._blocks.move_to_end(key)
            num_tokens = len(found) * b
            deferred = self._owed.take(tokens, num_tokens, limit)
        return StateHit(num_tokens, num_memory, num_tokens - num_memory, tuple(found), deferred)

    def store(self, tokens: Sequence[int], states: Sequence[tuple[int, BlockState]]) -> None:
        """Keep the states prefill took at boundaries `end` of `tokens` (memory and disk)."""
        if not states:
            return
        b = self.block_size
        keys = self._chain(tokens[: states[-1][0]])
        with self._lock:
            for end, state in states:
                j = end // b - 1
                block = tuple(tokens[end - b : end])
                self._keep(keys[j], block, state)
                if self.disk is not None:
                    parent = keys[j - 1] if j else self.disk.root_key(self.fingerprint)
                    self._write_disk(keys[j], parent, block, state)
            self._enforce_disk_budget()

    def release(self, hit: StateHit) -> None:
        """Nothing to unpin: a hit holds its blocks' tensors (for `KVCache`'s callers)."""

    # -- what KVCache's callers share ---------------------------------------------

    def remember_logits(self, tokens: Sequence[int], logits: torch.Tensor) -> None:
        with self._lock:
            self._logits.remember(tokens, logits)

    def last_logits(self, tokens: Sequence[int]) -> torch.Tensor | None:
        with self._lock:
            return self._logits.get(tokens)

    def defer(self, tokens: Sequence[int], num_canonical: int) -> None:
        """Owe `tokens[num_canonical:]` (owed.py): the next prompt holding them computes them."""
        with self._lock:
            self._owed.add(tokens, num_canonical)

    def owed(self) -> list[tuple[int, ...]]:
        with self._lock:
            return self._owed.sequences()

    def drop_live(self) -> None:
        """Nothing is live: every hit is restored from the blocks."""

    def flush(self) -> None:
        """Blocks are written inline: nothing is queued."""

    def take_disk_faults(self) -> DiskFaults:
        if self.disk is None:
            return DiskFaults(folder="")
        with self._lock:
            return self.disk.faults.take()

    def clear_memory(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._num_bytes = 0
            self._logits.clear()
            self._owed.clear()

    def block_states(self) -> list[BlockState]:
        """The memory tier's block states, oldest first (what `bench cache` sizes)."""
        with self._lock:
            return [entry.state for entry in self._blocks.values()]

    def memory_stats(self) -> TierStats:
        with self._lock:
            return TierStats(len(self._blocks), len(self._blocks) * self.block_size,
                             self._num_bytes, self.max_memory_bytes)

    def disk_stats(self) -> TierStats:
        if self.disk is None:
            return TierStats(0, 0, 0, self.disk_bytes)
        mine = [info for info in self.disk.scan() if info.fingerprint == self.fingerprint]
        return TierStats(len(mine), len(mine) * self.block_size,
                         sum(info.num_bytes for info in mine), self.disk_bytes)

    @property
    def disk_root(self) -> Path | None:
        return self.disk.root if self.disk is not None else None

    # -- internals -------------------------------------------------------------------

    def _chain(self, tokens: Sequence[int]) -> list[str]:
        return chain_keys(self.fingerprint, self.block_size, tokens)

    def _keep(self, key: str, block: tuple[int, ...], state: BlockState) -> None:
        if key in self._blocks:
            return
        self._blocks[key] = _Entry(block, state)
        self._num_bytes += state.num_bytes
        while self._num_bytes > self.max_memory_bytes and self._blocks:
            _, evicted = self._blocks.popitem(last=False)
            self._num_bytes -= evicted.state.num_bytes

    def _read_disk(self, key: str, block: tuple[int, ...]) -> BlockState | None:
        if self.disk is None:
            return None
        tensors = self.disk.read_state(key, block, self.fingerprint)
        if tensors is None:
            return None
        device = self.engine.device
        return BlockState({name: t.to(device) for name, t in tensors.items()})

    def _write_disk(self, key: str, parent: str, block: tuple[int, ...],
                    state: BlockState) -> None:
        assert self.disk is not None
        try:
            if self.disk.write_state(key, parent, self.fingerprint, block, state.tensors):
                self._written += state.num_bytes
        except BlockWriteError:
            pass  # logged in the store's faults; `take_disk_faults` hands them on

    def _enforce_disk_budget(self) -> None:
        if self.disk is None or self.disk_bytes is None or not self._written:
            return
        self._written = 0
        total = sum(info.num_bytes for info in self.disk.scan())
        if total > self.disk_bytes:
            self.disk.gc(self.disk_bytes)


PrefixCache = KVCache | StateCache  # what `open_cache` gives, and prefill and generate take


def open_cache(engine: Engine, **options: object) -> PrefixCache:
    """The prefix cache `engine`'s layers need: the radix tree for full attention
    everywhere, block states for window or state layers. `options` as `KVCache`'s."""
    cls = KVCache if engine.layout.is_plain else StateCache
    return cls(engine, **options)  # type: ignore[arg-type]
