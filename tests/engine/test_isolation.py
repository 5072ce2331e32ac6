"""KV is never reused across models: another config or another dtype never hits."""

from __future__ import annotations

import pytest
import torch

from kvtrace.engine import KVCache, load_engine, prefill
from kvtrace.errors import CacheError


def test_another_config_never_hits_the_disk_blocks(tiny_engine, other_engine, tokens, make_cache):
    prompt = tokens(200, seed=30)
    prefill(tiny_engine, make_cache(tiny_engine), prompt)
    assert tiny_engine.fingerprint != other_engine.fingerprint

    result = prefill(other_engine, make_cache(other_engine), prompt)

    assert result.num_cached_tokens == 0
    assert result.num_computed_tokens == 200


def test_another_dtype_never_hits_the_disk_blocks(
    tiny_engine, tiny_folder, engine_root, tokens, make_cache
):
    prompt = tokens(200, seed=31)
    prefill(tiny_engine, make_cache(tiny_engine), prompt)
    half = load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype=torch.bfloat16)
    assert half.fingerprint != tiny_engine.fingerprint

    result = prefill(half, make_cache(half), prompt)

    assert result.num_cached_tokens == 0
    assert half.kv_bytes_per_token * 2 == tiny_engine.kv_bytes_per_token


def test_a_memory_tier_refuses_another_engine(tiny_engine, other_engine, tokens):
    cache = KVCache(tiny_engine)
    prefill(tiny_engine, cache, tokens(50, seed=32))
    with pytest.raises(CacheError, match="another engine"):
        prefill(other_engine, cache, tokens(50, seed=32))


def test_the_same_model_loaded_twice_has_the_same_fingerprint(
    tiny_engine, tiny_folder, engine_root
):
    again = load_engine(tiny_folder, cache_dir=engine_root / "cache")
    assert again.fingerprint == tiny_engine.fingerprint
