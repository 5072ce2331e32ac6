"""The prefix cache of a model with window or state layers: block states, memory and disk.

A model whose every layer attends to the whole context keeps its KV in the
radix tree (cache.py) and resumes at any token. A model with sliding-window
or recurrent layers (layers.py) cannot: a recurrent layer resumes only where
a snapshot of its state was taken, and a window layer needs the last W - 1
rows before the point. So this cache keeps, per block of `block_size` tokens
(64 by default) that prefill passes, two parts (modelstate.py names the
tensors, `split_state` sorts them):

- **rows**: the block's K/V rows of the full-attention layers, kept for every
  block: every later resume point needs them;
- **resume**: what resuming *at this block's end* needs beyond the rows: a
  copy of every recurrent and convolution state there, and the block's rows
  of the window layers (at most W - 1). Kept only where a sequence prefill
  stored ends (its last block boundary), at checkpoints (below), and in the
  blocks within a window before either: the points where an agent's next
  call, a fork at step K or a repeated request resumes. Any other block
  keeps its rows alone. (Marconi's finding, kept simply: most states are
  never resumed
  from, and a real hybrid model's state is large, ~2 MB per DeltaNet layer
  for Qwen3-Next, so one per 64 tokens would outweigh its KV.) A later
  prefill that ends there adds the resume part then. Checkpoints bound how
  far back a fork parting inside one long prompt falls: every
  `CHECKPOINT_BLOCKS` blocks (1,024 tokens), or further apart where a
  resume part is large, so that one costs at most a quarter of the rows it
  spans (`checkpoint_blocks`: Gemma 3 270M's window of 512 rows, ~160 blocks).

A hit is the longest prefix that ends at a block boundary whose resume part
is cached and whose window rows reach back W - 1 tokens: the model's resume
points that this cache kept. `lookup` walks the chain from the root.

Blocks are keyed as the disk tier keys KV blocks (disk.py): a chain hash
seeded with the engine fingerprint, and every read compares the block's
token ids. Memory: an LRU of blocks under a byte budget; a lookup touches a
hit's blocks deepest first, so a prefix's ancestors are always fresher than
its tail and eviction takes tails first (a block whose ancestor was evicted
could never be reached). Disk: one safetensors file per part
(`BlockStore.write_state`), written inline, verified on read, found again
after a restart; a resume part is its rows block's child in the chain (its
key hashes the block's), so `gc` evicts it before the block, and
`disk_bytes` bounds the folder as for KV blocks.

Fidelity, by construction (stateprefill.py): every forward is one
block-aligned chunk, on the cold path and after a hit alike, so a resumed
prompt runs exactly the forwards a cold one runs from the same boundary, on
the same cached tensors: the same bits, at any dtype, with any attention
implementation. A model whose multi-token forward forgets its state
(`ModelLayout.steps_one_token`) runs one token per forward after its first
block, on both paths.

Sizes: full layers cost what they cost in the radix tree; window layers at
most W - 1 rows per kept resume point, state layers one snapshot per kept
resume point (a sequence's end, and a checkpoint that costs at most a
quarter of the rows it spans).
"""

from __future__ import annotations

import hashlib
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
from kvtrace.engine.deferred import DeferredOutputs
from kvtrace.engine.disk import BlockStore, chain_keys
from kvtrace.engine.faults import DiskFaults
from kvtrace.engine.lastlogits import LastLogits
from kvtrace.engine.model import Engine
from kvtrace.engine.modelstate import BlockState, kv_layer
from kvtrace.errors import BlockWriteError, UsageError

# A resume part is also kept every this many blocks at least (1,024 tokens at 64), so that a
# fork parting inside a long prompt resumes at most that far back (module docstring).
CHECKPOINT_BLOCKS = 16


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
    rows: BlockState
    resume: BlockState | None  # None: a block prompts only passed through (module docstring)

    @property
    def num_bytes(self) -> int:
        return self.rows.num_bytes + (self.resume.num_bytes if self.resume is not None else 0)


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
        windows = [layer.window for layer in engine.layout.layers if layer.window is not None]
        # Blocks before a resume point whose window rows it needs.
        self._window_blocks = -(-(max(windows) - 1) // block_size) if windows else 0
        self._window_layers = frozenset(i for i, layer in enumerate(engine.layout.layers)
                                        if layer.kind.is_windowed)
        self.checkpoint_blocks = checkpoint_blocks(engine, block_size)
        self._blocks: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._num_bytes = 0
        self._disk_total: int | None = None  # bytes in the folder: counted once, then kept
        self._logits = LastLogits()
        self._owed = DeferredOutputs()
        self._lock = threading.RLock()

    # -- lookup and store --------------------------------------------------------

    def lookup(self, tokens: Sequence[int], *, max_tokens: int | None = None) -> StateHit:
        """The longest prefix of `tokens` (at most `max_tokens`) ending at a kept resume point.

        Walks the chain by presence (memory, or a file on disk), chooses the
        deepest resume point, and only then reads from disk what that point
        needs: every block's rows, and the resume parts of its last window.
        """
        limit = len(tokens) if max_tokens is None else max(0, min(max_tokens, len(tokens)))
        b = self.block_size
        keys = self._chain(tokens[: limit - limit % b])
        with self._lock:
            has_resume: list[bool] = []
            for j, key in enumerate(keys):
                entry = self._blocks.get(key)
                if entry is not None and entry.tokens == tuple(tokens[j * b : (j + 1) * b]):
                    has_resume.append(entry.resume is not None or self._resume_on_disk(key))
                elif self.disk is not None and self.disk.contains(key):
                    has_resume.append(self._resume_on_disk(key))
                else:
                    break
            end = self._deepest_resume(has_resume)
            window = max(1, self._window_blocks)
            blocks: list[BlockState] = []
            num_memory = 0
            promoted: list[tuple[str, tuple[int, ...], BlockState, BlockState | None]] = []
            for j in range(end):
                block = tuple(tokens[j * b : (j + 1) * b])
                entry = self._blocks.get(keys[j])
                if entry is not None and entry.tokens != block:
                    entry = None
                rows = entry.rows if entry is not None else self._read_disk(keys[j], block)
                needs_resume = j >= end - window
                resume = entry.resume if entry is not None else None
                if needs_resume and resume is None:
                    resume = self._read_disk(resume_key(keys[j]), block)
                if rows is None or (needs_resume and resume is None):
                    # A file that would not read (damaged, deleted): resume earlier.
                    return self._lookup_before(tokens, j, limit)
                if entry is None or (resume is not None and entry.resume is None):
                    promoted.append((keys[j], block, rows, resume))
                num_memory += b if entry is not None else 0
                blocks.append(merge_states(rows, resume if needs_resume else None))
            for key, block, rows, resume in promoted:
                self._add(key, block, rows, resume)
            self._refresh(keys[:end])
            num_tokens = end * b
            deferred = self._owed.take(tokens, num_tokens, limit)
        return StateHit(num_tokens, num_memory, num_tokens - num_memory, tuple(blocks), deferred)

    def store(self, tokens: Sequence[int], states: Sequence[tuple[int, BlockState]]) -> None:
        """Keep the states prefill took at boundaries `end` of `tokens` (memory and disk).

        Every block keeps its rows; the resume parts of the blocks that end
        within a window of the sequence's last boundary are kept too (module
        docstring), the rest let go.
        """
        if not states:
            return
        b = self.block_size
        last = len(tokens) - len(tokens) % b
        keys = self._chain(tokens[: states[-1][0]])
        with self._lock:
            for end, state in states:
                j = end // b - 1
                block = tuple(tokens[end - b : end])
                rows, resume = split_state(state, self._window_layers)
                kept = resume if self._keeps_resume(end, last) else None
                self._add(keys[j], block, rows, kept)
                if self.disk is not None:
                    parent = keys[j - 1] if j else self.disk.root_key(self.fingerprint)
                    self._write_disk(keys[j], parent, block, rows, "rows")
                    if kept is not None:
                        self._write_disk(resume_key(keys[j]), keys[j], block, kept, "resume")
            self._refresh(keys)
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
        """Owe `tokens[num_canonical:]` (deferred.py): the next prompt holding them computes
        them."""
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
        """The memory tier's block states, rows and resume parts, oldest first (what
        `bench cache` sizes)."""
        with self._lock:
            return [part for entry in self._blocks.values()
                    for part in (entry.rows, entry.resume) if part is not None]

    def memory_stats(self) -> TierStats:
        with self._lock:
            return TierStats(len(self._blocks), len(self._blocks) * self.block_size,
                             self._num_bytes, self.max_memory_bytes)

    def disk_stats(self) -> TierStats:
        if self.disk is None:
            return TierStats(0, 0, 0, self.disk_bytes)
        mine = [info for info in self.disk.scan() if info.fingerprint == self.fingerprint]
        blocks = sum(1 for info in mine if info.part == "rows")
        return TierStats(blocks, blocks * self.block_size,
                         sum(info.num_bytes for info in mine), self.disk_bytes)

    @property
    def disk_root(self) -> Path | None:
        return self.disk.root if self.disk is not None else None

    # -- internals -------------------------------------------------------------------

    def _chain(self, tokens: Sequence[int]) -> list[str]:
        return chain_keys(self.fingerprint, self.block_size, tokens)

    def _keeps_resume(self, end: int, last: int) -> bool:
        """Whether the block ending at `end` keeps its resume part, in a sequence whose last
        block boundary is `last`: it is a kept resume point (`last`, or a checkpoint every
        `checkpoint_blocks` blocks), or lies within a window before one."""
        every = self.checkpoint_blocks * self.block_size
        point = min(last, -(-end // every) * every)  # the first kept point at or after `end`
        return end <= point and (end == point
                                 or (point - end) // self.block_size < self._window_blocks)

    def _deepest_resume(self, has_resume: list[bool]) -> int:
        """Blocks before the deepest boundary whose resume part, and the window rows of the
        blocks before it, are cached (0: none)."""
        w = self._window_blocks
        for end in range(len(has_resume), 0, -1):
            if has_resume[end - 1] and all(has_resume[max(0, end - w) : end]):
                return end
        return 0

    def _lookup_before(self, tokens: Sequence[int], j: int, limit: int) -> StateHit:
        """A lookup again, capped before block `j` (whose file would not read)."""
        return self.lookup(tokens, max_tokens=min(limit, j * self.block_size))

    def _resume_on_disk(self, key: str) -> bool:
        return self.disk is not None and self.disk.contains(resume_key(key))

    def _add(self, key: str, block: tuple[int, ...], rows: BlockState,
             resume: BlockState | None) -> None:
        """Put a block (or its newly kept resume part) in memory; `_refresh` evicts."""
        entry = self._blocks.get(key)
        if entry is None:
            entry = self._blocks[key] = _Entry(block, rows, resume)
            self._num_bytes += entry.num_bytes
        elif entry.resume is None and resume is not None:  # a sequence ends here now
            entry.resume = resume
            self._num_bytes += resume.num_bytes

    def _refresh(self, chain: Sequence[str]) -> None:
        """Mark a chain's blocks used, deepest first (so ancestors are fresher than their
        tails), then evict least recently used blocks past the budget: tails go first."""
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)
        while self._num_bytes > self.max_memory_bytes and self._blocks:
            _, evicted = self._blocks.popitem(last=False)
            self._num_bytes -= evicted.num_bytes

    def _read_disk(self, key: str, block: tuple[int, ...]) -> BlockState | None:
        if self.disk is None:
            return None
        tensors = self.disk.read_state(key, block, self.fingerprint)
        if tensors is None:
            return None
        device = self.engine.device
        return BlockState({name: t.to(device) for name, t in tensors.items()})

    def _write_disk(self, key: str, parent: str, block: tuple[int, ...],
                    state: BlockState, part: str) -> None:
        if self.disk is None:
            return
        try:
            if self.disk.write_state(key, parent, self.fingerprint, block, state.tensors,
                                     part=part) and self._disk_total is not None:
                self._disk_total += self.disk.path(key).stat().st_size
        except BlockWriteError:
            pass  # logged in the store's faults; `take_disk_faults` hands them on

    def _enforce_disk_budget(self) -> None:
        """Past `disk_bytes`, gc the folder (its total counted once, then kept up to date)."""
        if self.disk is None or self.disk_bytes is None:
            return
        if self._disk_total is None:
            self._disk_total = sum(info.num_bytes for info in self.disk.scan())
        if self._disk_total > self.disk_bytes:
            self._disk_total = self.disk.evict_to_budget(self.disk_bytes).num_bytes_left


def checkpoint_blocks(engine: Engine, block_size: int) -> int:
    """Blocks between checkpoints: `CHECKPOINT_BLOCKS`, or more where a resume part (states
    and a window of rows) would cost over a quarter of the full-attention rows it spans."""
    layers = engine.layout.layers
    rows = block_size * sum(layer.kv_bytes_per_token for layer in layers
                            if layer.kind.has_kv and not layer.kind.is_windowed)
    if rows == 0:  # every attention layer a window: against what full ones would hold
        rows = block_size * sum(layer.kv_bytes_per_token for layer in layers)
    resume = sum(layer.state_bytes + (layer.num_bytes(1 << 30) - layer.state_bytes
                                      if layer.kind.is_windowed else 0) for layer in layers)
    if rows == 0:  # recurrent layers only: a state is all there is to keep
        return CHECKPOINT_BLOCKS
    return max(CHECKPOINT_BLOCKS, -(-4 * resume // rows))


def split_state(state: BlockState, window_layers: frozenset[int]) -> tuple[BlockState,
                                                                            BlockState]:
    """A block state's rows part (full-attention K/V) and resume part (the rest)."""
    rows: dict[str, torch.Tensor] = {}
    resume: dict[str, torch.Tensor] = {}
    for name, tensor in state.tensors.items():
        layer = kv_layer(name)
        is_rows = layer is not None and layer not in window_layers
        (rows if is_rows else resume)[name] = tensor
    return BlockState(rows), BlockState(resume)


def merge_states(rows: BlockState, resume: BlockState | None) -> BlockState:
    return BlockState({**rows.tensors, **(resume.tensors if resume is not None else {})})


def resume_key(key: str) -> str:
    """The disk key of a block's resume part: a child of the block in the chain."""
    return hashlib.sha256(bytes.fromhex(key) + b"resume").hexdigest()


PrefixCache = KVCache | StateCache  # what `open_cache` gives, and prefill and generate take


def open_cache(engine: Engine, **options: object) -> PrefixCache:
    """The prefix cache `engine`'s layers need: the radix tree for full attention
    everywhere, block states for window or state layers. `options` as `KVCache`'s."""
    cls = KVCache if engine.layout.is_plain else StateCache
    return cls(engine, **options)  # type: ignore[arg-type]
