"""Disk tier: damaged blocks are never used, restarts find blocks, sizes and gc hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load

from kvtrace.engine import KVCache, prefill
from kvtrace.engine.disk import BlockStore


def _block_files(kv_dir):
    return sorted(kv_dir.rglob("*.safetensors"))


def _content(raw: bytes):
    """Metadata and tensors of a block file (safetensors' header key order varies)."""
    header_len = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8 : 8 + header_len])["__metadata__"]
    tensors = {k: v.tolist() for k, v in load(raw).items()}
    return meta, tensors


def _second_block(cache, engine, prompt):
    key = cache.disk.chain_keys(engine.fingerprint, prompt)[1]
    return cache.disk.path(key)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_block_is_skipped_recomputed_and_replaced(
    tiny_engine, tokens, make_cache, kv_equal, damage
):
    prompt = tokens(260, seed=40)
    writer = make_cache(tiny_engine)
    prefill(tiny_engine, writer, prompt)
    path = _second_block(writer, tiny_engine, prompt)
    original = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(original[: len(original) // 2])
    else:  # one bit in the middle of the KV data, header intact
        flipped = bytearray(original)
        flipped[len(flipped) * 2 // 3] ^= 0x10
        path.write_bytes(bytes(flipped))

    reader = make_cache(tiny_engine)
    hot = prefill(tiny_engine, reader, prompt)
    cold = prefill(tiny_engine, None, prompt)

    assert hot.num_disk_tokens == 64  # block 0 only: the damaged block 1 ends the walk
    assert hot.num_computed_tokens == 260 - 64
    assert reader.disk.num_corrupt == 1
    assert torch.equal(hot.logits, cold.logits) and kv_equal(hot, cold)
    rewritten = path.read_bytes()  # rewritten from the recomputation, same content
    assert _content(rewritten) == _content(original)
    assert prefill(tiny_engine, make_cache(tiny_engine), prompt).num_disk_tokens == 256


def test_a_new_process_finds_and_hits_the_disk_blocks(
    tiny_engine, tiny_folder, engine_root, tokens, kv_dir
):
    prompt = tokens(300, seed=41)
    reference = prefill(tiny_engine, KVCache(tiny_engine, disk_dir=kv_dir), prompt)
    script = textwrap.dedent(
        f"""
        import json, torch
        from kvtrace.engine import KVCache, load_engine, prefill
        engine = load_engine({str(tiny_folder)!r}, cache_dir={str(engine_root / "cache")!r})
        cache = KVCache(engine, disk_dir={str(kv_dir)!r})
        result = prefill(engine, cache, {prompt!r} + [11, 12])
        print(json.dumps({{
            "disk": result.num_disk_tokens,
            "memory": result.num_memory_tokens,
            "computed": result.num_computed_tokens,
            "fingerprint": engine.fingerprint,
        }}))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    assert report["fingerprint"] == tiny_engine.fingerprint
    assert report == {**report, "disk": 256, "memory": 0, "computed": 302 - 256}
    assert reference.num_computed_tokens == 300


def test_stored_size_per_token_is_within_2_percent_of_the_formula(
    tiny_engine, tokens, make_cache, kv_dir
):
    prefill(tiny_engine, make_cache(tiny_engine), tokens(640, seed=42))
    files = _block_files(kv_dir)
    per_token = sum(f.stat().st_size for f in files) / (len(files) * 64)

    assert len(files) == 10
    assert tiny_engine.kv_bytes_per_token == 2 * 2 * 2 * 64 * 4
    assert abs(per_token / tiny_engine.kv_bytes_per_token - 1) < 0.02


@pytest.mark.slow
def test_default_model_block_size_per_token_matches_the_formula(
    default_engine, tokens, make_cache, kv_dir
):
    prefill(default_engine, make_cache(default_engine), tokens(129, seed=43))
    files = _block_files(kv_dir)
    per_token = sum(f.stat().st_size for f in files) / (len(files) * 64)

    assert default_engine.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert abs(per_token / default_engine.kv_bytes_per_token - 1) < 0.02


def test_gc_evicts_least_recently_used_tails_and_never_orphans(
    tiny_engine, tokens, make_cache, kv_dir
):
    old, new = tokens(320, seed=44), tokens(320, seed=45)
    prefill(tiny_engine, make_cache(tiny_engine), old)
    time.sleep(0.05)
    prefill(tiny_engine, make_cache(tiny_engine), new)
    store = BlockStore(kv_dir)
    block_bytes = _block_files(kv_dir)[0].stat().st_size

    result = store.gc(max_bytes=7 * block_bytes)

    left = {info.key: info for info in store.scan()}
    assert result.num_blocks_left == len(left) == 7
    assert result.num_bytes_left <= 7 * block_bytes
    for info in left.values():  # every survivor's parent survives (or is the chain root)
        assert info.parent in left or info.parent == store.root_key(tiny_engine.fingerprint)
    new_keys = store.chain_keys(tiny_engine.fingerprint, new)
    assert all(key in left for key in new_keys)  # the recent chain is whole
    assert prefill(tiny_engine, make_cache(tiny_engine), old).num_disk_tokens == 128


def test_the_disk_budget_holds_under_a_stream_of_prompts(tiny_engine, tokens, make_cache, kv_dir):
    block_bytes = None
    for seed in range(12):
        cache = make_cache(tiny_engine, disk_bytes=600_000)
        prefill(tiny_engine, cache, tokens(200, seed=100 + seed))
        total = sum(f.stat().st_size for f in _block_files(kv_dir))
        block_bytes = block_bytes or _block_files(kv_dir)[0].stat().st_size
        assert total <= 600_000
    assert block_bytes and len(_block_files(kv_dir)) == 600_000 // block_bytes
