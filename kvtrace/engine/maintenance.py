"""Cache upkeep for the CLI and programs: stats, garbage collection, verification.

`verify_blocks` is the cache's `fsck`: it recomputes a sample of stored disk
blocks from scratch (cold, canonical prefill of the block's whole prefix,
rebuilt by following parent keys back to the chain root) and compares the
KV bit for bit. A mismatch means the fidelity scheme broke (or the numeric
setup changed without changing the fingerprint) — never expected.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtrace.engine.cache import DEFAULT_BLOCK_SIZE, DEFAULT_MEMORY_BYTES
from kvtrace.engine.disk import BlockInfo, BlockStore, GcResult
from kvtrace.engine.faults import read_disk_record
from kvtrace.engine.model import Engine
from kvtrace.engine.modelstate import ModelState
from kvtrace.engine.prefilling import kv_rows, prefill
from kvtrace.engine.statecache import resume_key
from kvtrace.errors import UsageError

KV_DIRNAME = "kv"


def default_kv_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """Where disk KV blocks live under a kvtrace cache folder."""
    return Path(cache_dir) / KV_DIRNAME


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Sizes of both tiers, the KV size per token of the engine, and the disk tier's health.

    `num_failed_writes` counts block writes that failed in every process
    that could record it (faults.py: a read-only folder cannot), the last
    one's reason in `last_failed_write`; `num_evicted_blocks` those evicted
    past a budget (`$KVTRACE_KV_DISK_MAX`), not by `gc`; `is_disk_writable` and
    `disk_free_bytes` say whether the folder can take blocks now.
    """

    model: str
    fingerprint: str
    block_size: int
    kv_bytes_per_token: int
    disk_dir: str
    disk_blocks: int
    disk_bytes: int
    disk_blocks_all_models: int
    disk_bytes_all_models: int
    disk_bytes_per_token: float | None
    memory_entries: int
    memory_bytes: int
    memory_max_bytes: int
    num_failed_writes: int = 0
    last_failed_write: str | None = None
    num_evicted_blocks: int = 0
    is_disk_writable: bool = True
    disk_free_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Outcome of `verify_blocks`: keys that failed, by reason.

    `unreadable` blocks (or an unreadable ancestor) failed their checksum or
    token check and were deleted, as any read of a damaged block does;
    `orphaned` ones lost an ancestor (e.g. to a crash mid-gc) and are
    unreachable, so they cannot be recomputed.
    """

    num_blocks: int
    num_checked: int
    mismatched: tuple[str, ...]
    unreadable: tuple[str, ...]
    orphaned: tuple[str, ...]

    @property
    def is_ok(self) -> bool:
        return not (self.mismatched or self.unreadable)


def cache_stats(
    engine: Engine,
    disk_dir: str | os.PathLike[str],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> CacheStats:
    """Stats of the disk tier under `disk_dir`.

    The memory figures are those of a fresh process, whose memory tier is
    empty: this command's.
    """
    store = BlockStore(disk_dir, block_size=block_size)
    files = list(store.scan())  # a state block's resume part is a file, not a block of its own
    every = [info for info in files if info.part == "rows"]
    mine = [info for info in every if info.fingerprint == engine.fingerprint]
    mine_bytes = sum(info.num_bytes for info in files if info.fingerprint == engine.fingerprint)
    failures = read_disk_record(Path(disk_dir))
    is_writable, free = folder_space(Path(disk_dir))
    return CacheStats(
        model=engine.name,
        fingerprint=engine.fingerprint,
        block_size=block_size,
        kv_bytes_per_token=engine.kv_bytes_per_token,
        disk_dir=str(disk_dir),
        disk_blocks=len(mine),
        disk_bytes=mine_bytes,
        disk_blocks_all_models=len(every),
        disk_bytes_all_models=sum(info.num_bytes for info in files),
        disk_bytes_per_token=mine_bytes / (len(mine) * block_size) if mine else None,
        memory_entries=0,
        memory_bytes=0,
        memory_max_bytes=DEFAULT_MEMORY_BYTES,
        num_failed_writes=failures.num_failed_writes,
        last_failed_write=failures.last_reason,
        num_evicted_blocks=failures.num_evicted_blocks,
        is_disk_writable=is_writable,
        disk_free_bytes=free,
    )


def folder_space(folder: Path) -> tuple[bool, int | None]:
    """Whether blocks can be written under `folder` (or where it would be made), and free bytes."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        info = os.statvfs(probe)
    except OSError:
        return False, None
    is_writable = not info.f_flag & os.ST_RDONLY and os.access(probe, os.W_OK)
    return is_writable, info.f_bavail * info.f_frsize


def collect_garbage(disk_dir: str | os.PathLike[str], max_bytes: int) -> GcResult:
    """Evict disk blocks (tails first, least recently used) down to `max_bytes`."""
    if max_bytes < 0:
        raise UsageError(f"max_bytes={max_bytes}: must be >= 0", param="max_bytes")
    return BlockStore(disk_dir).gc(max_bytes)


def verify_blocks(
    engine: Engine,
    disk_dir: str | os.PathLike[str],
    *,
    sample: int | None = 8,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> VerifyReport:
    """Recompute up to `sample` of this engine's blocks (all when None) and compare."""
    if sample is not None and sample < 0:
        raise UsageError(f"sample={sample}: must be >= 0 (None: every block)", param="sample")
    store = BlockStore(disk_dir, block_size=block_size)
    # A state block's resume part is checksummed, not recomputed: its rows block is.
    mine = {info.key: info for info in store.scan()
            if info.fingerprint == engine.fingerprint and info.part == "rows"}
    keys = sorted(mine)
    if sample is not None and sample < len(keys):
        keys = sorted(random.Random(seed).sample(keys, sample))
    root = store.root_key(engine.fingerprint)
    mismatched: list[str] = []
    unreadable: list[str] = []
    orphaned: list[str] = []
    checked = 0
    for key in keys:
        chain = _chain_to_root(mine, key, root)
        if chain is None:
            orphaned.append(key)
            continue
        is_state = not engine.layout.is_plain
        tokens: list[int] = []
        blocks: list[Any] = []
        for info in chain:
            block_tokens = _stored_tokens(info)
            if block_tokens is None:
                break
            block = (store.read_state(info.key, block_tokens, engine.fingerprint) if is_state
                     else store.read(info.key, block_tokens))
            if block is None:
                break
            tokens.extend(block_tokens)
            blocks.append(block)
        if len(blocks) != len(chain):
            unreadable.append(key)
            continue
        resume = None
        if is_state and store.contains(resume_key(key)):
            resume = store.read_state(resume_key(key), tokens[-block_size:],
                                      engine.fingerprint)
            if resume is None:  # damaged: read_state removed it (a miss from now on)
                unreadable.append(resume_key(key))
                continue
        matches = (_state_matches(engine, tokens, blocks[-1], resume, block_size)
                   if is_state else _kv_matches(engine, tokens, blocks[-1], block_size))
        if matches is None:
            continue
        checked += 1
        if not matches:
            mismatched.append(key)
    return VerifyReport(
        num_blocks=len(mine),
        num_checked=checked,
        mismatched=tuple(mismatched),
        unreadable=tuple(unreadable),
        orphaned=tuple(orphaned),
    )


def _kv_matches(engine: Engine, tokens: list[int], target: Any, block_size: int) -> bool:
    """Whether a cold, canonical computation of `tokens` gives the last block's KV."""
    result = prefill(engine, None, tokens, block_size=block_size)
    start = len(tokens) - block_size
    recomputed_k, recomputed_v = kv_rows(result.kv)(start, len(tokens))
    return torch.equal(recomputed_k.cpu(), target.keys) and torch.equal(
        recomputed_v.cpu(), target.values)


def _state_matches(engine: Engine, tokens: list[int], target: dict[str, torch.Tensor],
                   resume: dict[str, torch.Tensor] | None, block_size: int) -> bool | None:
    """Whether computing `tokens` cold leaves what the last block's files hold: its rows,
    and its resume part (states, window rows) when one was kept; None when they hold no
    tensor (a recurrent model's block a prompt passed through: nothing to compare)."""
    wanted = {**target, **(resume or {})}
    if not wanted:
        return None
    result = prefill(engine, None, tokens, block_size=block_size)
    if not isinstance(result.kv, ModelState):
        return False
    cold = result.kv.snapshot(len(tokens) - block_size, len(tokens)).tensors
    return wanted.keys() <= cold.keys() and all(
        torch.equal(cold[name].cpu(), tensor) for name, tensor in wanted.items())


def _chain_to_root(blocks: dict[str, BlockInfo], key: str, root: str) -> list[BlockInfo] | None:
    """Blocks from the chain root down to `key`, or None if an ancestor is gone."""
    chain: list[BlockInfo] = []
    walk = key
    while walk != root:
        info = blocks.get(walk)
        if info is None or len(chain) > 1_000_000:
            return None
        chain.append(info)
        walk = info.parent
    chain.reverse()
    return chain


def _stored_tokens(info: BlockInfo) -> list[int] | None:
    """The token ids a block file claims to hold (verified again by `read`)."""
    from safetensors import safe_open

    try:
        with safe_open(str(info.path), framework="pt") as fh:
            return [int(t) for t in fh.get_tensor("token_ids").tolist()]
    except Exception:  # damaged file: safetensors raises assorted error types
        return None


@dataclass(frozen=True, slots=True)
class KindSize:
    """What the layers of one kind hold after some tokens."""

    kind: str
    num_layers: int
    window: int | None  # the largest window among them (window kinds)
    kv_bytes_per_token: int  # summed over the layers (0: no KV)
    state_bytes: int  # summed over the layers (0: no state)
    num_bytes: int


@dataclass(frozen=True, slots=True)
class CacheSize:
    """`cache_size`: bytes per layer kind for a number of tokens, one sequence."""

    model: str
    dtype: str
    num_tokens: int
    kinds: tuple[KindSize, ...]
    num_bytes: int


def cache_size(engine: Engine, num_tokens: int) -> CacheSize:
    """Bytes the cache of one `num_tokens`-token sequence holds, per layer kind (layers.py).

    Full layers: 2 x KV heads x head dim x tokens x element size each;
    window layers the same for min(tokens, window); state layers constant.
    """
    if num_tokens < 0:
        raise UsageError(f"tokens={num_tokens}: must be >= 0", param="tokens")
    rows = []
    for kind, indices in engine.layout.kinds().items():
        layers = [engine.layout.layers[i] for i in indices]
        windows = [layer.window for layer in layers if layer.window is not None]
        rows.append(KindSize(
            kind=str(kind),
            num_layers=len(layers),
            window=max(windows) if windows else None,
            kv_bytes_per_token=sum(layer.kv_bytes_per_token for layer in layers),
            state_bytes=sum(layer.state_bytes for layer in layers),
            num_bytes=sum(layer.num_bytes(num_tokens) for layer in layers),
        ))
    return CacheSize(engine.name, str(engine.dtype).removeprefix("torch."), num_tokens,
                     tuple(rows), sum(row.num_bytes for row in rows))
