"""The two-tier KV prefix cache of one engine: radix tree in memory, blocks on disk.

`lookup` finds the longest token-exact cached prefix of a sequence: first in
the memory tree (any offset), then by walking disk blocks from the root
(whole blocks only, verified on read). Disk rows beyond what memory held are
promoted into the tree. `store` keeps a freshly computed sequence: the new
tail in the tree, and every full block not yet on disk. Both tiers are
keyed by the engine fingerprint (the tree belongs to one engine; the disk
chain is seeded with the fingerprint), so KV never crosses models.

Live sequences: the last sequences prefill computed (up to `LIVE_SEQUENCES`,
and a quarter of the memory budget) keep their per-layer KV buffers
(`store`, kvbuffer.py), and the memory tree borrows their rows from them
rather than holding a copy (radix.py, loans). A lookup whose hit a live
sequence covers hands its buffers out (`PrefixHit.live`), and the prefill
takes them over, writing after the reused rows in place: the prompt that
extends an earlier one (every call of an agent run) starts with no copy,
and the run's KV exists once in memory. Several are kept because runs
interleave: forks of one run, or agents sharing a server, send calls in
turns, and with one live sequence each call copied its whole prefix out of
the tree (~11 ms at 3,000 tokens for the default model, 4 % of the call).
Loans that reach rows about to be overwritten, or buffers about to be let
go, are repaid (copied into the tree) first. It changes no accounting: the
hit is what the tiers hold, and a loan counts in the memory budget as the
copy it stands for; the buffers' earlier rows are the bound's to limit.

Last logits (`remember_logits`, `last_logits`, lastlogits.py): the
last-position logits of the most recent sequences prefill computed, so an
exact repeat needs no forward at all.

Deferred output (`defer`, deferred.py): a generation's decoded output that the
next prompt's prefill stores; a lookup reports it (`num_deferred_tokens`).

The disk half (walking a chain, writing blocks inline or behind, the disk
budget) is disktier.py. Its faults (a block that cannot be written, one
found damaged) never stop a computation; `take_disk_faults` hands them to
the caller to show (faults.py).

The cache never computes anything: `kvtrace.engine.prefilling` calls it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtrace.engine.deferred import DeferredOutputs
from kvtrace.engine.disk import BlockLayout, BlockStore
from kvtrace.engine.disktier import DiskTier
from kvtrace.engine.faults import DiskFaults
from kvtrace.engine.kvbuffer import GrowingLayer, KVBuffer, buffer_rows
from kvtrace.engine.lastlogits import LastLogits
from kvtrace.engine.model import Engine
from kvtrace.engine.radix import RadixNode, RadixTree, common_prefix
from kvtrace.errors import CacheError, UsageError

DEFAULT_BLOCK_SIZE = 64
DEFAULT_MEMORY_BYTES = 2 * 1024**3
MIN_BLOCK_SIZE = 16
LIVE_SEQUENCES = 8  # computed sequences whose buffers the next prefills may extend in place


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The reusable prefix of a sequence; release it with `KVCache.release`.

    Either `live` holds a live sequence's per-layer buffers, handed over to
    the caller, who takes them over from row `num_tokens` (`pieces` is then
    empty), or `pieces` are KV tensors `[layers, kv_heads, n, head_dim]`
    covering tokens `0 … num_tokens` in order. `num_disk_blocks` counts the
    leading blocks known to be on disk (so `store` skips rewriting them).
    `num_deferred_tokens` follow the hit: an earlier generation's output,
    owed to the cache (deferred.py), which the caller computes now.
    """

    num_tokens: int
    num_memory_tokens: int
    num_disk_tokens: int
    num_disk_blocks: int
    pieces: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    pinned: RadixNode | None
    live: tuple[KVBuffer, ...] | None = None
    num_deferred_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LiveSequence:
    """A computed sequence's per-layer KV buffers (each keeping its tokens' rows)."""

    tokens: tuple[int, ...]
    buffers: tuple[KVBuffer, ...]

    @property
    def num_bytes(self) -> int:
        return sum(2 * b.keys.numel() * b.keys.element_size() for b in self.buffers)


@dataclass(frozen=True, slots=True)
class TierStats:
    """Size of one tier."""

    num_entries: int
    num_tokens: int
    num_bytes: int
    max_bytes: int | None


class KVCache:
    """Memory and disk KV tiers for one engine.

    `disk_dir=None` keeps the cache in memory only. `memory_bytes` bounds the
    tree (LRU leaves are evicted past it); `disk_bytes`, when set, runs a disk
    `gc` after writes that push the folder past it. `block_size` is both the
    disk block and the prefill chunk length (see prefilling.py); it must be a
    multiple of 16 (smaller matmuls are not row-invariant on CPU).
    `write_behind` writes disk blocks on a background thread (see writer.py;
    call `flush` before reading the folder by other means).

    One thread at a time: the lock keeps the tiers consistent, but a
    prefill's result shares buffers with the cache (decoding on it writes in
    place), so a cache and the results of its prefills belong to one thread
    (the server runs one engine worker).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        disk_dir: str | os.PathLike[str] | None = None,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        disk_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        write_behind: bool = False,
    ) -> None:
        check_block_size(block_size)
        if memory_bytes < 0 or (disk_bytes is not None and disk_bytes < 0):
            raise UsageError("cache budgets must be >= 0 bytes")
        self.engine = engine
        self.fingerprint = engine.fingerprint
        self.block_size = block_size
        self.memory = RadixTree(max_bytes=memory_bytes)
        layout = BlockLayout(  # what a disk block must be to be used by this engine
            engine.fingerprint, engine.dtype, engine.num_layers, engine.num_kv_heads,
            engine.head_dim,
        )
        self._disk = DiskTier(
            BlockStore(disk_dir, block_size=block_size), layout, max_bytes=disk_bytes,
            write_behind=write_behind,
        ) if disk_dir is not None else None
        self._lives: list[LiveSequence] = []  # oldest first
        self._live_bytes = memory_bytes // 4
        # The buffers the tree borrows from, one tuple per lender (its loans name it).
        self._lenders: list[tuple[KVBuffer, ...]] = []
        self._owed = DeferredOutputs()
        self._logits = LastLogits()
        self._lock = threading.RLock()

    @property
    def disk_bytes(self) -> int | None:
        """The disk tier's budget (None: no automatic gc, or no disk tier)."""
        return self._disk.max_bytes if self._disk is not None else None

    @property
    def disk(self) -> BlockStore | None:
        """The disk tier's block folder (None for a memory-only cache)."""
        return self._disk.store if self._disk is not None else None

    # -- lookup ---------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], *, max_tokens: int | None = None,
               kv: bool = True) -> PrefixHit:
        """Longest cached prefix of `tokens`, reusing at most `max_tokens` of them.

        `kv=False` counts the hit without its KV (no pieces, no live buffers
        taken): for a caller that computes nothing when it covers everything.

        The hit is pinned in memory; pass it to `release` when done. When a
        live sequence covers it, the hit takes that sequence's buffers out
        (loans reaching past it are repaid first): a lookup is for a prefill
        that computes the rest, as `prefill` does.
        """
        limit = len(tokens) if max_tokens is None else max(0, min(max_tokens, len(tokens)))
        with self._lock:
            match = self.memory.match(tokens, max_tokens=limit)
            num_memory = match.num_tokens
            num_disk_blocks, disk_pieces = (
                self._disk.walk(tokens, num_memory, limit, self.engine.device)
                if self._disk is not None else (0, [])
            )
            disk_end = min(num_disk_blocks * self.block_size, limit)
            num_disk = disk_end - num_memory if disk_end > num_memory and disk_pieces else 0
            num_tokens = num_memory + num_disk
            covering = self._live_covering(tokens, num_tokens) if kv else None
            from_live = covering is not None
            # Before an insert splits nodes.
            pieces = list(match.pieces()) if kv and not from_live else []
            node = match.node
            if num_disk:
                keys = torch.cat([k for k, _ in disk_pieces], dim=2)
                values = torch.cat([v for _, v in disk_pieces], dim=2)
                base = (num_memory // self.block_size) * self.block_size
                lo, hi = num_memory - base, disk_end - base
                keys, values = keys[:, :, lo:hi], values[:, :, lo:hi]
                if kv and not from_live:
                    pieces.append((keys, values))

                def source(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
                    return keys[:, :, start - num_memory : end - num_memory].clone(), values[
                        :, :, start - num_memory : end - num_memory
                    ].clone()

                self.memory.insert(tokens[:disk_end], source)  # promote
                node = self.memory.match(tokens, max_tokens=disk_end).node
            # May copy: before pinning.
            live = self._take_live(covering, num_tokens) if covering is not None else None
            pinned = node if node is not self.memory.root else None
            if pinned is not None:
                self.memory.pin(pinned)
            # Counting only settles nothing: the prefill that follows a short count does.
            deferred = self._owed.take(tokens, num_tokens, limit) if kv else 0
            return PrefixHit(
                num_deferred_tokens=deferred,
                num_tokens=num_tokens,
                num_memory_tokens=num_memory,
                num_disk_tokens=num_disk,
                num_disk_blocks=num_disk_blocks,
                pieces=tuple(pieces),
                pinned=pinned,
                live=live,
            )

    # -- store ----------------------------------------------------------------

    def store(
        self, tokens: Sequence[int], layers: Sequence[GrowingLayer], *, num_disk_blocks: int = 0
    ) -> None:
        """Store a sequence prefill just computed, and keep it as the newest live one.

        `layers` are its DynamicCache's, canonical in their first
        `len(tokens)` rows, which they must keep (`GrowingLayer.freeze`).
        The tree borrows the new rows from their buffers instead of copying
        them; disk blocks are copies. `num_disk_blocks` leading blocks are
        known to be on disk already.
        """
        n = len(tokens)
        if any(layer.get_seq_length() < n for layer in layers):
            raise CacheError("live KV is shorter than its tokens")
        with self._lock:
            frozen = tuple(layer.freeze(n) for layer in layers)
            buffers = self._lender(frozen)
            if buffers is None:
                buffers = frozen
                self._lenders.append(buffers)
            self._lives = [live for live in self._lives if live.buffers is not buffers]
            self._lives.append(LiveSequence(tuple(tokens), buffers))
            self._let_go()
            rows = buffer_rows(buffers)
            self.memory.insert(tokens, rows, loan_bytes=self.engine.kv_bytes_per_token,
                               lender=buffers)
            if self._disk is not None:
                self._disk.write(tokens, rows, num_disk_blocks)

    def defer(self, tokens: Sequence[int], num_canonical: int) -> None:
        """Owe the cache `tokens[num_canonical:]`, decoded after the cached prompt before it.

        The next lookup of a sequence holding them reports them (deferred.py).
        """
        with self._lock:
            self._owed.add(tokens, num_canonical)

    def owed(self) -> list[tuple[int, ...]]:
        """The sequences whose output is still owed (oldest first): see `defer`."""
        with self._lock:
            return self._owed.sequences()

    def remember_logits(self, tokens: Sequence[int], logits: torch.Tensor) -> None:
        """Keep the canonical last-position logits of `tokens` (lastlogits.py)."""
        with self._lock:
            self._logits.remember(tokens, logits)

    def last_logits(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """A copy of the logits `remember_logits` kept for exactly `tokens`, or None."""
        with self._lock:
            return self._logits.get(tokens)

    def drop_live(self) -> None:
        """Forget the live sequences (their KV stays in the tiers: the tree copies its loans)."""
        with self._lock:
            self.memory.repay()
            self._lives = []
            self._lenders = []

    def _live_covering(self, tokens: Sequence[int], num_tokens: int) -> LiveSequence | None:
        """A live sequence holding the first `num_tokens` of `tokens`: the one with the fewest
        rows past them (the fewest loans to repay), the newest of those.

        A prompt that extends a live sequence takes it over at no cost; one
        that parts from it (a fork) takes it over too, repaying its rows past
        the fork, which costs less than copying the whole prefix out of the tree.
        """
        if num_tokens == 0:
            return None
        covering = [live for live in self._lives if len(live.tokens) >= num_tokens
                    and common_prefix(live.tokens, tokens, num_tokens) == num_tokens]
        return min(reversed(covering), key=lambda live: len(live.tokens), default=None)

    def _take_live(self, live: LiveSequence, num_tokens: int) -> tuple[KVBuffer, ...]:
        """`live`'s buffers, taken out for a prefill that writes from `num_tokens` on.

        Its loans reaching those rows are repaid first; only one prefill may
        write into the buffers, so the record lets go of them (the tree
        still borrows the rows below, which nobody overwrites).
        """
        self.memory.repay(num_tokens, lender=live.buffers)
        self._lives.remove(live)
        return live.buffers

    def _lender(self, buffers: tuple[KVBuffer, ...]) -> tuple[KVBuffer, ...] | None:
        """The lender whose buffers are `buffers`, layer by layer (the tuple its loans name)."""
        return next((lent for lent in self._lenders
                     if all(a is b for a, b in zip(lent, buffers, strict=True))), None)

    def _let_go(self) -> None:
        """Keep the newest live sequences within the bounds (always the newest one); repay
        the loans of every lender no live sequence holds any more (module docstring)."""
        while len(self._lives) > 1 and (
                len(self._lives) > LIVE_SEQUENCES
                or sum(live.num_bytes for live in self._lives) > self._live_bytes):
            self._lives.pop(0)
        for lent in [lent for lent in self._lenders
                     if not any(live.buffers is lent for live in self._lives)]:
            self.memory.repay(lender=lent)
            self._lenders.remove(lent)

    def release(self, hit: PrefixHit) -> None:
        """Unpin what `lookup` pinned."""
        if hit.pinned is not None:
            with self._lock:
                self.memory.unpin(hit.pinned)

    def flush(self) -> None:
        """Wait until every block this cache queued is on disk (no-op when writing inline)."""
        if self._disk is not None:
            self._disk.flush()

    def take_disk_faults(self) -> DiskFaults:
        """Blocks the disk tier could not write, or found damaged and recomputed, since last asked.

        The disk tier never stops a computation for these (faults.py); this
        is how its caller learns of them and says so. Empty for a
        memory-only cache.
        """
        if self._disk is None:
            return DiskFaults(folder="")
        with self._lock:
            return self._disk.take_faults()

    # -- inventory --------------------------------------------------------------

    def clear_memory(self) -> None:
        """Drop the memory tier, the live sequences, owed output and kept logits (the disk
        tier is untouched)."""
        with self._lock:
            self.memory.clear()
            self._logits.clear()
            self._lives = []
            self._lenders = []
            self._owed.clear()

    def memory_stats(self) -> TierStats:
        return TierStats(
            num_entries=self.memory.num_nodes,
            num_tokens=self.memory.num_tokens,
            num_bytes=self.memory.num_bytes,
            max_bytes=self.memory.max_bytes,
        )

    def disk_stats(self) -> TierStats:
        """Blocks of this engine's fingerprint (reads every block header)."""
        if self._disk is None:
            return TierStats(0, 0, 0, self.disk_bytes)
        mine = self._disk.blocks()
        return TierStats(
            num_entries=len(mine),
            num_tokens=len(mine) * self.block_size,
            num_bytes=sum(info.num_bytes for info in mine),
            max_bytes=self.disk_bytes,
        )

    @property
    def disk_root(self) -> Path | None:
        return self.disk.root if self.disk is not None else None


def check_block_size(block_size: int) -> None:
    """Block sizes that keep canonical prefill row-invariant (see attention.py)."""
    if block_size < MIN_BLOCK_SIZE or block_size % MIN_BLOCK_SIZE:
        raise UsageError(
            f"block size must be a positive multiple of {MIN_BLOCK_SIZE}, got {block_size}"
        )
