"""The disk half of a `KVCache`: walking a sequence's block chain, writing new blocks.

disk.py knows one block (its key, file, checks) and the folder (scan, gc);
this module knows what a cache asks of the folder for a whole sequence:

- `walk`: how many leading blocks of a sequence are on disk, loading (and
  verifying) only those past what the memory tier already holds;
- `write`: every full block of a freshly computed sequence not yet there,
  inline or queued for the write-behind thread (writer.py), then the disk
  budget (`max_bytes`) enforced by gc;
- a block queued for writing counts as on disk and is served from the queue,
  so a lookup in this process never misses a block still on its way;
- a block that cannot be written (a full or read-only folder) ends that
  sequence's writing (its later blocks would hang from a missing parent);
  the computation goes on, and `take_faults` hands the caller what was
  logged (faults.py), write-behind failures included.

`walk` and `write` run under the cache's lock (they change the folder the
tree's view depends on); nothing here locks on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtrace.engine.disk import BlockInfo, BlockLayout, BlockStore
from kvtrace.engine.faults import DiskFaults
from kvtrace.engine.radix import KVSource
from kvtrace.engine.writer import BlockWriter, PendingBlock, writer_for
from kvtrace.errors import BlockWriteError


class DiskTier:
    """One cache's view of a block folder: its engine's layout, block size and budget."""

    def __init__(self, store: BlockStore, layout: BlockLayout, *, max_bytes: int | None = None,
                 write_behind: bool = False) -> None:
        self.store = store
        self.layout = layout
        self.max_bytes = max_bytes
        self._writer: BlockWriter | None = writer_for(store) if write_behind else None
        self._total: int | None = None  # bytes in the folder, counted once then kept up to date

    def walk(
        self, tokens: Sequence[int], num_memory: int, limit: int, device: torch.device
    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Count leading blocks on disk; load (and verify) those past `num_memory`.

        Blocks wholly inside the memory hit, or past `limit`, are only checked
        for existence: their KV is not needed, only whether `write` must
        write them.
        """
        b = self.store.block_size
        loaded: list[tuple[torch.Tensor, torch.Tensor]] = []
        count = 0
        for j, key in enumerate(self.store.chain_keys(self.layout.fingerprint, tokens)):
            end = (j + 1) * b
            if end <= num_memory or j * b >= limit:
                if not self._contains(key):
                    break
            else:
                kv = self._read(key, tokens[j * b : end])
                if kv is None:
                    break
                loaded.append((kv[0].to(device), kv[1].to(device)))
            count += 1
        return count, loaded

    def write(self, tokens: Sequence[int], source: KVSource, num_disk_blocks: int) -> None:
        """Write every full block of `tokens` past the first `num_disk_blocks` not on disk yet.

        `source(start, end)` yields the KV of rows `start … end`, copied.
        """
        fingerprint = self.layout.fingerprint
        b = self.store.block_size
        keys = self.store.chain_keys(fingerprint, tokens)
        parent = keys[num_disk_blocks - 1] if num_disk_blocks else self.store.root_key(fingerprint)
        written = 0
        for j in range(num_disk_blocks, len(keys)):
            if self._writer is not None and self._writer.contains(keys[j]):
                parent = keys[j]
                continue  # skip copying the KV of a block already there
            k, v = source(j * b, (j + 1) * b)
            block_tokens = tokens[j * b : (j + 1) * b]
            try:
                if self._write_block(keys[j], parent, block_tokens, k, v):
                    written += k.numel() * k.element_size() * 2
            except BlockWriteError:  # logged by the store: the rest would be unreachable
                break
            parent = keys[j]
        self._enforce_budget(written)

    def flush(self) -> None:
        """Wait until every block queued for writing is on disk (no-op when writing inline)."""
        if self._writer is not None:
            self._writer.flush()

    def take_faults(self) -> DiskFaults:
        """What the folder's blocks made this tier recover from since last asked (faults.py).

        A write-behind failure is handed to the first cache on the folder
        that asks (the writer is shared).
        """
        faults = self.store.faults.take()
        if self._writer is None:
            return faults
        return faults.plus(self._writer.store.faults.take())

    def blocks(self) -> list[BlockInfo]:
        """Every block of this engine's fingerprint (reads every header; flushes first)."""
        self.flush()
        return [info for info in self.store.scan() if info.fingerprint == self.layout.fingerprint]

    def _contains(self, key: str) -> bool:
        if self._writer is not None:
            return self._writer.contains(key)
        return self.store.contains(key)

    def _read(self, key: str, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A block's KV if it holds exactly `tokens`: queued for writing, or read and verified."""
        if self._writer is not None:
            queued = self._writer.pending(key, tokens)
            if queued is not None:
                return queued.keys, queued.values
        block = self.store.read(key, tokens, self.layout)
        return (block.keys, block.values) if block is not None else None

    def _write_block(self, key: str, parent: str, tokens: Sequence[int], keys: torch.Tensor,
                     values: torch.Tensor) -> bool:
        fingerprint = self.layout.fingerprint
        if self._writer is not None:
            return self._writer.submit(
                PendingBlock(key, parent, fingerprint, tuple(tokens), keys, values)
            )
        return self.store.write(key, parent, fingerprint, tokens, keys, values)

    def _enforce_budget(self, written: int) -> None:
        if self.max_bytes is None or written == 0:
            return
        self.flush()  # gc must see every block, or it could drop a queued block's parent
        if self._total is None:
            self._total = sum(info.num_bytes for info in self.store.scan())
        else:
            self._total += written
        if self._total > self.max_bytes:
            self._total = self.store.evict_to_budget(self.max_bytes).num_bytes_left
