"""Write-behind disk blocks: same hits and bits as inline writes, whole files only."""

from __future__ import annotations

import json
import threading

import torch
from safetensors.torch import load

from kvtrace.engine import KVCache, prefill
from kvtrace.engine.disk import BlockStore
from kvtrace.engine.writer import BlockWriter, PendingBlock, writer_for


def _block(store: BlockStore, index: int) -> PendingBlock:
    keys = torch.full((2, 2, store.block_size, 4), float(index))
    return PendingBlock(f"{index:064x}", "0" * 64, "fp", tuple(range(store.block_size)),
                        keys, keys + 1)


def test_a_second_cache_in_the_process_hits_blocks_still_queued(
    tiny_engine, tokens, kv_dir, kv_equal
):
    prompt = tokens(300, seed=60)
    first = KVCache(tiny_engine, disk_dir=kv_dir, write_behind=True)
    prefill(tiny_engine, first, prompt[:200] + tokens(30, seed=61))

    second = KVCache(tiny_engine, disk_dir=kv_dir, write_behind=True)  # memory empty
    hot = prefill(tiny_engine, second, prompt)
    cold = prefill(tiny_engine, None, prompt)

    assert (hot.num_memory_tokens, hot.num_disk_tokens) == (0, 192)
    assert torch.equal(hot.logits, cold.logits)
    assert kv_equal(hot, cold)


def test_flush_leaves_every_block_on_disk_whole_and_verified(tiny_engine, tokens, kv_dir):
    prompt = tokens(330, seed=62)
    cache = KVCache(tiny_engine, disk_dir=kv_dir, write_behind=True)
    prefill(tiny_engine, cache, prompt)
    cache.flush()

    store = BlockStore(kv_dir)
    keys = store.chain_keys(tiny_engine.fingerprint, prompt)
    assert len(list(kv_dir.rglob("*.safetensors"))) == len(keys) == 5
    assert all(store.read(key, prompt[j * 64 : (j + 1) * 64]) is not None
               for j, key in enumerate(keys))
    assert not list(kv_dir.rglob(".tmp-*"))


def test_inline_and_write_behind_caches_write_the_same_bytes(tiny_engine, tokens, tmp_path):
    prompt = tokens(200, seed=63)
    inline = KVCache(tiny_engine, disk_dir=tmp_path / "inline")
    behind = KVCache(tiny_engine, disk_dir=tmp_path / "behind", write_behind=True)
    prefill(tiny_engine, inline, prompt)
    prefill(tiny_engine, behind, prompt)
    behind.flush()

    def contents(folder):
        """Per file: metadata and tensors (safetensors' header key order varies)."""
        out = {}
        for path in folder.rglob("*.safetensors"):
            raw = path.read_bytes()
            header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
            tensors = {k: v.tolist() for k, v in load(raw).items()}
            out[path.relative_to(folder)] = (header["__metadata__"], tensors)
        return out

    assert contents(tmp_path / "inline") == contents(tmp_path / "behind")


def test_one_writer_serves_every_cache_on_a_folder(tiny_engine, kv_dir):
    a = KVCache(tiny_engine, disk_dir=kv_dir, write_behind=True)
    b = KVCache(tiny_engine, disk_dir=kv_dir / ".." / kv_dir.name, write_behind=True)
    assert writer_for(a.disk) is writer_for(b.disk)


def test_a_full_queue_makes_submit_wait_and_a_queued_block_is_served(tmp_path):
    store = BlockStore(tmp_path / "kv", block_size=16)
    writer = BlockWriter(store, max_pending=1)
    gate = threading.Lock()
    gate.acquire()
    real_write = store.write

    def slow_write(*args, **kwargs):
        with gate:  # held by the test: the thread stalls on its first block
            return real_write(*args, **kwargs)

    store.write = slow_write  # type: ignore[method-assign]
    assert writer.submit(_block(store, 1))
    while writer.pending(_block(store, 1).key, range(16)) is None:
        pass
    assert writer.submit(_block(store, 2))  # queued behind the stalled one
    assert writer.contains(_block(store, 2).key)
    assert not writer.submit(_block(store, 2))  # already queued
    served = writer.pending(_block(store, 2).key, range(16))
    assert served is not None and torch.equal(served.keys, _block(store, 2).keys)
    assert writer.pending(_block(store, 2).key, range(1, 17)) is None  # tokens compared

    gate.release()
    writer.flush()
    assert len(list((tmp_path / "kv").rglob("*.safetensors"))) == 2
