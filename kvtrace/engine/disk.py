"""Disk tier: fixed-size KV blocks, content-addressed by a chain hash.

A sequence is cut into blocks of `block_size` tokens at absolute offsets.
Block j's key is `SHA-256(key(j-1) || token ids of block j)`, and key(-1) is
`SHA-256(format tag, model fingerprint, block size)` — as in vLLM's prefix
caching, a key pins the whole prefix and the model, and a block can only be
reached through all of its ancestors. Never Python's salted `hash()`.

Each block is one safetensors file at `<root>/<key[:2]>/<key[2:]>.safetensors`
holding `keys` and `values` (`[layers, kv_heads, block_size, head_dim]`), the
block's `token_ids`, and metadata: its key, its parent's key, the fingerprint
and a SHA-256 checksum of the three tensors. Invariants:

- files appear atomically (temporary file in the same folder, `os.replace`),
  so a reader sees a whole block or none; a restart needs no index;
- a read compares the stored token ids with the requested ones (a hash
  collision can never give a wrong hit), the stored fingerprint, dtype and
  KV shape (layers, KV heads, head dim) with the reader's `BlockLayout` (the
  chain hash already depends on the fingerprint: this check does not trust
  it), and re-checks the checksum; a block
  that fails to parse or check is deleted and reported as a miss, so the
  caller recomputes and rewrites it — corrupt KV is never used;
- eviction (`gc`) removes only tails — blocks that no other block names as
  parent — least recently used first (reads refresh the file's mtime), so a
  surviving block's ancestors always survive with it; a cache at its budget
  evicts through `evict_to_budget`, which logs and counts what went.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import os
import struct
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from kvtrace.engine.faults import FaultLog, count_evictions, count_failed_write, reserve_count
from kvtrace.errors import BlockWriteError

BLOCK_FORMAT = "kvtrace-kv-block-v1"
STATE_FORMAT = "kvtrace-state-block-v1"  # a model's resume state per block (statecache.py)
SUFFIX = ".safetensors"
_STALE_TMP_SECONDS = 3600.0
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class DiskBlock:
    """A verified block read back from disk."""

    key: str
    keys: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What a reader's engine needs a block to be: its model and the shape of its KV."""

    fingerprint: str
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What `scan` learns from a block file's header, without reading its KV."""

    key: str
    parent: str
    fingerprint: str
    path: Path
    num_bytes: int
    mtime: float
    is_readable: bool
    # A state block's part (statecache.py): "rows", or "resume" (a child of its rows block).
    part: str = "rows"


@dataclass(frozen=True, slots=True)
class GcResult:
    """Outcome of `BlockStore.gc`."""

    num_blocks_removed: int
    num_bytes_removed: int
    num_blocks_left: int
    num_bytes_left: int


class BlockStore:
    """The on-disk KV blocks of every model under one folder."""

    def __init__(self, root: str | os.PathLike[str], *, block_size: int = 64) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.root = Path(root)
        self.block_size = block_size
        self.num_corrupt = 0
        self.faults = FaultLog(self.root)
        self._has_count = False  # the failed-write record made (faults.reserve_count)

    # -- keys ---------------------------------------------------------------

    def root_key(self, fingerprint: str) -> str:
        """The chain seed for one model fingerprint and block size."""
        return root_key(fingerprint, self.block_size)

    def chain_keys(self, fingerprint: str, tokens: Sequence[int]) -> list[str]:
        """Keys of every full block of `tokens`, in order."""
        return chain_keys(fingerprint, self.block_size, tokens)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key[2:]}{SUFFIX}"

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    # -- read / write -------------------------------------------------------

    def read(
        self, key: str, tokens: Sequence[int], layout: BlockLayout | None = None
    ) -> DiskBlock | None:
        """The block at `key` if it holds exactly `tokens`, fits `layout` and checks out.

        A file that exists but fails any check is deleted (counted in
        `num_corrupt`, logged in `faults`) so that the recomputed block can
        replace it.
        """
        raw = self._read_bytes(key)
        if raw is None:
            return None
        return self._checked(key, _parse_block(raw, key, tokens, layout))

    def write(
        self,
        key: str,
        parent: str,
        fingerprint: str,
        tokens: Sequence[int],
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> bool:
        """Store one block atomically; False when it already exists.

        A write that fails (`OSError`, or safetensors' own error for the same
        causes) leaves no temporary file, is logged and counted (module
        docstring) and raises `BlockWriteError`.
        """
        path = self.path(key)
        if path.is_file():
            return False
        token_ids = torch.tensor(list(tokens), dtype=torch.int64)
        keys = keys.detach().to("cpu").contiguous()
        values = values.detach().to("cpu").contiguous()
        metadata = {
            "format": BLOCK_FORMAT,
            "key": key,
            "parent": parent,
            "fingerprint": fingerprint,
            "block_size": str(self.block_size),
            "checksum": _checksum(token_ids, keys, values),
        }
        self._write_file(path, key, {"keys": keys, "values": values, "token_ids": token_ids},
                         metadata)
        return True

    def write_state(self, key: str, parent: str, fingerprint: str, tokens: Sequence[int],
                    tensors: dict[str, torch.Tensor], *, part: str = "rows") -> bool:
        """Store one block of a model's resume state (statecache.py) atomically, as `write`.

        `tensors` are named as `modelstate.BlockState` names them; the
        checksum covers the token ids and every tensor, in name order.
        """
        path = self.path(key)
        if path.is_file():
            return False
        token_ids = torch.tensor(list(tokens), dtype=torch.int64)
        named = {name: t.detach().to("cpu").contiguous() for name, t in sorted(tensors.items())}
        metadata = {
            "format": STATE_FORMAT,
            "part": part,
            "key": key,
            "parent": parent,
            "fingerprint": fingerprint,
            "block_size": str(self.block_size),
            "checksum": _checksum(token_ids, *named.values()),
        }
        self._write_file(path, key, {**named, "token_ids": token_ids}, metadata)
        return True

    def read_state(self, key: str, tokens: Sequence[int], fingerprint: str
                   ) -> dict[str, torch.Tensor] | None:
        """The state block at `key` if it holds exactly `tokens` for `fingerprint` and checks
        out (a damaged one is deleted and reported, as `read` does)."""
        raw = self._read_bytes(key)
        if raw is None:
            return None
        return self._checked(key, _parse_state_block(raw, key, tokens, fingerprint))

    def _read_bytes(self, key: str) -> bytes | None:
        """A block file's bytes; None when it is missing or unreadable (then discarded)."""
        path = self.path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._discard(path, key, f"unreadable: {exc.strerror or exc}")
            return None

    def _checked(self, key: str, parsed: _T | str) -> _T | None:
        """A parsed block, its file's LRU clock refreshed; a refusal (a reason) discards it."""
        if isinstance(parsed, str):
            self._discard(self.path(key), key, parsed)
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path(key))  # LRU clock for gc
        return parsed

    def _write_file(self, path: Path, key: str, tensors: dict[str, torch.Tensor],
                    metadata: dict[str, str]) -> None:
        """Write a block file atomically; a failure leaves no temporary file, is logged and
        counted, and raises `BlockWriteError`.

        `save_file` writes the tensors' memory straight to the file: building
        the file's bytes in memory first (`save`) then writing them cost ~6 ms
        more per 2.95 MB block (allocating and faulting in the copy).
        """
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        tmp: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not self._has_count:  # before the first block, while there is room
                reserve_count(self.root)
                self._has_count = True
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=path.parent)
            os.close(fd)
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, path)
        except BaseException as exc:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    Path(tmp).unlink(missing_ok=True)
            if not isinstance(exc, OSError | SafetensorError):
                raise
            reason = _write_failure_reason(exc)
            self.faults.failed_write(reason, is_counted=count_failed_write(self.root, reason))
            raise BlockWriteError(
                f"cannot write KV block {key[:16]} under {self.root}: {reason}"
            ) from exc

    # -- inventory, gc ------------------------------------------------------

    def scan(self) -> Iterator[BlockInfo]:
        """Every block file's header (no KV is read); unreadable ones flagged."""
        if not self.root.is_dir():
            return
        for sub in sorted(self.root.iterdir()):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub):
                if not entry.name.endswith(SUFFIX) or entry.name.startswith(".tmp-"):
                    continue
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue
                key = sub.name + entry.name[: -len(SUFFIX)]
                meta = _read_metadata(Path(entry.path))
                is_readable = meta is not None and meta.get("key") == key
                yield BlockInfo(
                    key=key,
                    parent=(meta or {}).get("parent", ""),
                    fingerprint=(meta or {}).get("fingerprint", ""),
                    path=Path(entry.path),
                    num_bytes=stat.st_size,
                    mtime=stat.st_mtime,
                    is_readable=is_readable,
                    part=(meta or {}).get("part", "rows"),
                )

    def gc(self, max_bytes: int) -> GcResult:
        """Evict tail blocks, least recently used first, until ≤ `max_bytes` remain.

        Unreadable block files go first; stale temporary files are removed.
        """
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._remove_stale_tmp()
        blocks = {info.key: info for info in self.scan()}
        total = sum(info.num_bytes for info in blocks.values())
        num_children: dict[str, int] = {}
        for info in blocks.values():
            if info.parent in blocks:
                num_children[info.parent] = num_children.get(info.parent, 0) + 1
        heap = [
            (info.is_readable, info.mtime, key)
            for key, info in blocks.items()
            if num_children.get(key, 0) == 0 or not info.is_readable
        ]
        heapq.heapify(heap)
        removed = removed_bytes = 0
        while total > max_bytes and heap:
            _, _, key = heapq.heappop(heap)
            if key not in blocks:
                continue
            info = blocks.pop(key)
            info.path.unlink(missing_ok=True)
            total -= info.num_bytes
            removed += 1
            removed_bytes += info.num_bytes
            parent = blocks.get(info.parent)
            if parent is not None:
                num_children[parent.key] -= 1
                if num_children[parent.key] == 0:
                    heapq.heappush(heap, (parent.is_readable, parent.mtime, parent.key))
        return GcResult(removed, removed_bytes, len(blocks), total)

    def evict_to_budget(self, max_bytes: int) -> GcResult:
        """`gc` for a cache at its budget: what it evicts is logged in `faults` and
        counted in the folder's record (faults.py), so the command that evicted says so
        and `cache stats` counts it (a `kvtrace cache gc` the user asks for is not)."""
        result = self.gc(max_bytes)
        if result.num_blocks_removed:
            self.faults.evicted(result.num_blocks_removed, result.num_bytes_removed, max_bytes)
            count_evictions(self.root, result.num_blocks_removed)
        return result

    def _discard(self, path: Path, key: str, reason: str) -> None:
        self.num_corrupt += 1
        try:
            path.unlink(missing_ok=True)
        except OSError:  # a read-only folder: a miss all the same, at every read
            self.faults.damaged(key, reason, is_deleted=False)
        else:
            self.faults.damaged(key, reason)

    def _remove_stale_tmp(self) -> None:
        if not self.root.is_dir():
            return
        cutoff = time.time() - _STALE_TMP_SECONDS
        for tmp in self.root.glob("*/.tmp-*"):
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:
                continue


def root_key(fingerprint: str, block_size: int) -> str:
    """The chain seed for one model fingerprint and block size."""
    return hashlib.sha256(f"{BLOCK_FORMAT}\0{fingerprint}\0{block_size}".encode()).hexdigest()


def chain_keys(fingerprint: str, block_size: int, tokens: Sequence[int]) -> list[str]:
    """Keys of every full block of `tokens`, in order (the module docstring's chain)."""
    keys: list[str] = []
    parent = root_key(fingerprint, block_size)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.sha256(bytes.fromhex(parent))
        digest.update(_token_bytes(tokens[start : start + block_size]))
        parent = digest.hexdigest()
        keys.append(parent)
    return keys


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def _checksum(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _load(raw: bytes) -> tuple[dict[str, str], dict[str, torch.Tensor]] | str:
    """A block file's metadata and tensors; why not, when its bytes do not parse."""
    from safetensors.torch import load

    try:
        header_len = struct.unpack("<Q", raw[:8])[0]
        meta = json.loads(raw[8 : 8 + header_len]).get("__metadata__", {})
        tensors = load(raw)
    except Exception:  # safetensors raises its own error types on damage
        return "not a readable block file: truncated or damaged" if raw else "empty file"
    return meta, tensors


def _parse_block(
    raw: bytes, key: str, tokens: Sequence[int], layout: BlockLayout | None = None
) -> DiskBlock | str:
    """Decode and check a block file's bytes; on any mismatch or damage, why it is refused."""
    loaded = _load(raw)
    if isinstance(loaded, str):
        return loaded
    meta, tensors = loaded
    token_ids, keys, values = tensors.get("token_ids"), tensors.get("keys"), tensors.get("values")
    if token_ids is None or keys is None or values is None:
        return "a tensor is missing"
    if meta.get("format") != BLOCK_FORMAT or meta.get("key") != key:
        return "its header names another block or format"
    if token_ids.tolist() != list(tokens):
        return "its token ids differ from the prompt's"
    if keys.shape != values.shape or keys.dim() != 4 or keys.shape[2] != len(tokens):
        return "its KV has the wrong shape"
    if layout is not None:
        if meta.get("fingerprint") != layout.fingerprint:
            return "written by another model: its fingerprint differs"
        if keys.dtype != layout.dtype or values.dtype != layout.dtype:
            return f"its KV is {keys.dtype}, the engine's {layout.dtype}"
        if (keys.shape[0], keys.shape[1], keys.shape[3]) != (
            layout.num_layers, layout.num_kv_heads, layout.head_dim
        ):
            return "its layers, KV heads or head dim differ from the engine's"
    if meta.get("checksum") != _checksum(token_ids, keys, values):
        return "checksum mismatch: its bytes changed after it was written"
    return DiskBlock(key=key, keys=keys, values=values)


def _parse_state_block(
    raw: bytes, key: str, tokens: Sequence[int], fingerprint: str
) -> dict[str, torch.Tensor] | str:
    """Decode and check a state block's bytes; on any mismatch or damage, why it is refused."""
    loaded = _load(raw)
    if isinstance(loaded, str):
        return loaded
    meta, tensors = loaded
    token_ids = tensors.pop("token_ids", None)
    if token_ids is None:
        return "a tensor is missing"
    if meta.get("format") != STATE_FORMAT or meta.get("key") != key:
        return "its header names another block or format"
    if token_ids.tolist() != list(tokens):
        return "its token ids differ from the prompt's"
    if meta.get("fingerprint") != fingerprint:
        return "written by another model: its fingerprint differs"
    named = dict(sorted(tensors.items()))
    if meta.get("checksum") != _checksum(token_ids, *named.values()):
        return "checksum mismatch: its bytes changed after it was written"
    return named


def _write_failure_reason(exc: BaseException) -> str:
    """The OS's words for a failed write ("No space left on device"), from either error type."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    if "I/O error: " in text:  # safetensors: "Error while serializing: I/O error: … (os error 28)"
        text = text.split("I/O error: ", 1)[1]
        text = text.split(" (os error", 1)[0]
    return text or type(exc).__name__


def _read_metadata(path: Path) -> dict[str, str] | None:
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                return None
            (header_len,) = struct.unpack("<Q", head)
            if header_len > 1 << 20:
                return None
            header = json.loads(fh.read(header_len))
        meta = header.get("__metadata__")
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None
