"""The GEMM setting canonical prefill relies on is in force (kvtrace/engine/numerics.py)."""

from __future__ import annotations

import os

import pytest

from kvtrace.engine.numerics import MKL_SETTING, rows_are_invariant


def test_importing_the_engine_requests_reproducible_gemm():
    import kvtrace.engine  # noqa: F401

    assert os.environ.get(MKL_SETTING[0]) == MKL_SETTING[1]


def test_tiny_model_rows_are_invariant(tiny_engine):
    assert rows_are_invariant(tiny_engine.model)


@pytest.mark.slow
def test_default_model_rows_are_invariant(default_engine):
    """Fails where MKL splits a product's reduction by row count (it did on AVX-512 Xeons)."""
    assert rows_are_invariant(default_engine.model)


def test_bfloat16_warns_exactly_where_the_cpu_lacks_it(tiny_folder, engine_root):
    """A bfloat16 engine on an x86 CPU without AVX-512 BF16 or AMX says it will be slow
    (~14x slower than float32 on an AVX2 EPYC); float32, or a CPU with it, says nothing."""
    import platform
    import warnings

    import torch

    from kvtrace.engine import load_engine
    from kvtrace.engine.numerics import native_bfloat16

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert native_bfloat16() == (bool(native) if x86 else None)
    for dtype, slow in (("float32", False), ("bfloat16", native_bfloat16() is False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype=dtype)
        said = [w for w in caught if "no native bfloat16" in str(w.message)]
        assert len(said) == int(slow), dtype
