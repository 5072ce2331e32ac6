"""Write-behind for the disk tier: blocks are written by a background thread.

Writing a block (checksum, safetensors encoding, the file) costs ~13 ms for
the default model's 2.95 MB blocks, and an agent's call makes a few: off the
critical path it overlaps the next call's compute. Invariants:

- one writer per disk folder in a process (`writer_for`), shared by every
  `KVCache` on that folder, so a block queued by one cache is seen by all:
  `pending` serves its KV (the same tensors that will be written) and
  `contains` counts it as present — a lookup in this process never misses a
  block because it is still queued;
- the writer thread calls `BlockStore.write` (temporary file, then
  `os.replace`), so a crash at any moment leaves only whole blocks: queued
  blocks are lost, and recomputed by whoever needs them next;
- at most `max_pending` blocks wait (their KV copies are held in memory):
  past that, `submit` waits, so a long cold prefill cannot queue unbounded
  memory; `flush` waits for the queue to drain (`KVCache.flush`, and an
  `atexit` hook so that a normal exit writes everything);
- a block whose write fails (a full or read-only disk) is dropped, counted
  in `num_failed` and logged in its store's `faults` with the reason, which
  the caches on the folder hand on (`DiskTier.take_faults`): the disk tier is
  a cache, the computation never depends on it, but a failure is shown.
"""

from __future__ import annotations

import atexit
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtrace.engine.disk import BlockStore
from kvtrace.errors import BlockWriteError

DEFAULT_MAX_PENDING = 32


@dataclass(frozen=True, slots=True)
class PendingBlock:
    """A block waiting to be written: everything `BlockStore.write` needs."""

    key: str
    parent: str
    fingerprint: str
    tokens: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor


class BlockWriter:
    """A background thread writing blocks to one folder, in submission order."""

    def __init__(self, store: BlockStore, *, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.store = store
        self.max_pending = max_pending
        self.num_failed = 0
        self._queue: OrderedDict[str, PendingBlock] = OrderedDict()
        self._busy: PendingBlock | None = None
        self._unwritten: set[str] = set()  # keys that failed: their queued children are dropped
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvtrace-block-writer", daemon=True)
        self._thread.start()

    def submit(self, block: PendingBlock) -> bool:
        """Queue a block unless it is on disk or queued already; False when it was."""
        with self._changed:
            if self._is_pending(block.key) or self.store.contains(block.key):
                return False
            while len(self._queue) >= self.max_pending:
                self._changed.wait()
            self._queue[block.key] = block
            self._changed.notify_all()
            return True

    def pending(self, key: str, tokens: Sequence[int]) -> PendingBlock | None:
        """The queued (or being written) block at `key` if it holds exactly `tokens`."""
        with self._changed:
            block = self._queue.get(key)
            if block is None and self._busy is not None and self._busy.key == key:
                block = self._busy
        if block is None or list(block.tokens) != list(tokens):
            return None
        return block

    def contains(self, key: str) -> bool:
        """On disk, or on its way there."""
        with self._changed:
            if self._is_pending(key):
                return True
        return self.store.contains(key)

    def flush(self) -> None:
        """Wait until every queued block is written (or has failed)."""
        with self._changed:
            while self._queue or self._busy is not None:
                self._changed.wait()

    def _is_pending(self, key: str) -> bool:
        return key in self._queue or (self._busy is not None and self._busy.key == key)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue:
                    self._changed.wait()
                _, block = self._queue.popitem(last=False)
                self._busy = block
                self._changed.notify_all()  # room in the queue
            try:
                if block.parent in self._unwritten:  # unreachable without its parent
                    self._unwritten.add(block.key)
                else:
                    self.store.write(
                        block.key, block.parent, block.fingerprint, block.tokens,
                        block.keys, block.values,
                    )
            except BlockWriteError:  # a full or read-only disk: logged by the store
                self._failed(block)
            except Exception as exc:  # not the disk's doing: logged all the same, as a bug
                self._failed(block)
                self.store.faults.failed_write(f"{type(exc).__name__}: {exc}")
            finally:
                with self._changed:
                    self._busy = None
                    self._changed.notify_all()

    def _failed(self, block: PendingBlock) -> None:
        self.num_failed += 1
        if len(self._unwritten) > 4096:  # a bound, not a cache: old chains are long gone
            self._unwritten.clear()
        self._unwritten.add(block.key)


_writers: dict[tuple[Path, int], BlockWriter] = {}
_writers_lock = threading.Lock()


def writer_for(store: BlockStore) -> BlockWriter:
    """The one writer of `store`'s folder and block size in this process."""
    where = (store.root.resolve(), store.block_size)
    with _writers_lock:
        writer = _writers.get(where)
        if writer is None:
            writer = _writers[where] = BlockWriter(BlockStore(where[0], block_size=where[1]))
        return writer


def flush_all() -> None:
    """Write every queued block of every folder (runs at normal interpreter exit)."""
    with _writers_lock:
        writers = list(_writers.values())
    for writer in writers:
        writer.flush()


atexit.register(flush_all)
