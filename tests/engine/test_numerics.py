"""The GEMM setting canonical prefill relies on is in force (kvtrace/numerics.py)."""

from __future__ import annotations

import os

import pytest

from kvtrace.numerics import MKL_SETTING, rows_are_invariant


def test_importing_the_engine_requests_reproducible_gemm():
    import kvtrace.engine  # noqa: F401

    assert os.environ.get(MKL_SETTING[0]) == MKL_SETTING[1]


def test_tiny_model_rows_are_invariant(tiny_engine):
    assert rows_are_invariant(tiny_engine.model)


@pytest.mark.slow
def test_default_model_rows_are_invariant(default_engine):
    """Fails where MKL splits a product's reduction by row count (it did on AVX-512 Xeons)."""
    assert rows_are_invariant(default_engine.model)
