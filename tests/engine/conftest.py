"""Fixtures for the engine and KV cache tests.

Real parts only: tiny randomly initialised Llama models written from a config
(with the default model's converted tokenizer, so no hub is needed), and the
real default model for the `slow` tests. The default model is converted once
into the kvtrace cache folder ($KVTRACE_CACHE or ~/.cache/kvtrace) and
reused; KV blocks always go to temporary folders.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtrace.engine import (
    Engine,
    KVCache,
    PrefillResult,
    build_tiny_model,
    default_model_dir,
    load_engine,
)
from kvtrace.paths import default_cache_dir

TINY = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64}


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return default_model_dir(default_cache_dir())


@pytest.fixture(scope="session")
def engine_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-models")


@pytest.fixture(scope="session")
def tiny_folder(engine_root, tokenizer_dir) -> Path:
    return build_tiny_model(engine_root / "tiny", tokenizer_dir=tokenizer_dir, seed=7, **TINY)


@pytest.fixture(scope="session")
def tiny_engine(tiny_folder, engine_root) -> Engine:
    """2 layers, 4 query heads sharing 2 KV heads (GQA), 2,048 KV bytes per token."""
    return load_engine(tiny_folder, cache_dir=engine_root / "cache")


@pytest.fixture(scope="session")
def bf16_engine(tiny_folder, engine_root) -> Engine:
    """`tiny_engine`'s model in bfloat16 (`--dtype bfloat16`)."""
    return load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype="bfloat16")


@pytest.fixture(scope="session")
def other_engine(engine_root, tokenizer_dir) -> Engine:
    """Another config (3 layers) — must never share KV with `tiny_engine`."""
    folder = build_tiny_model(
        engine_root / "other", tokenizer_dir=tokenizer_dir, seed=7, **{**TINY, "num_layers": 3}
    )
    return load_engine(folder, cache_dir=engine_root / "cache")


@pytest.fixture(scope="session")
def default_engine() -> Engine:
    return load_engine(None, cache_dir=default_cache_dir())


@pytest.fixture
def kv_dir(tmp_path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def make_cache(kv_dir) -> Callable[..., KVCache]:
    """`make_cache(engine, **options)`: a KVCache on this test's disk folder."""

    def make(engine: Engine, **options) -> KVCache:
        options.setdefault("disk_dir", kv_dir)
        return KVCache(engine, **options)

    return make


def _kv_equal(a: PrefillResult, b: PrefillResult) -> bool:
    layers_a, layers_b = a.kv.layers, b.kv.layers  # type: ignore[attr-defined]
    return len(layers_a) == len(layers_b) and all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        for x, y in zip(layers_a, layers_b, strict=True)
    )


@pytest.fixture
def kv_equal() -> Callable[[PrefillResult, PrefillResult], bool]:
    """`kv_equal(a, b)`: bit-identical K and V in every layer, same length."""
    return _kv_equal


@pytest.fixture
def tokens() -> Callable[..., list[int]]:
    """`tokens(n, seed=0)`: n random token ids, deterministic per seed."""

    def make(n: int, seed: int = 0) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(100, 49000) for _ in range(n)]

    return make
