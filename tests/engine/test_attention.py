"""The canonical attention computes attention: close to torch's own, row by row exact.

The parity tests (test_parity.py) prove a cached row gets a cold run's bits
through whole models; these check the function itself against
`scaled_dot_product_attention`, whose sums run in another order, so the two
agree to rounding, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtrace.engine import attention

HEADS, KV_HEADS, DIM = 6, 2, 64


def _inputs(kv_len: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, HEADS, kv_len, DIM, generator=generator) * 2
    key = torch.randn(1, KV_HEADS, kv_len, DIM, generator=generator)
    value = torch.randn(1, KV_HEADS, kv_len, DIM, generator=generator)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _canonical(query, key, value, lo: int, hi: int) -> torch.Tensor:
    """Queries lo..hi-1 over keys 0..hi-1, as a prefill chunk computes them: [b, q, heads, dim]."""
    with torch.inference_mode():  # as in a forward (its scratch buffers are inference tensors)
        out, _ = attention.canonical_attention(
            None, query[:, :, lo:hi].contiguous(), key[:, :, :hi].contiguous(),
            value[:, :, :hi].contiguous(), None)
    return out


def _reference(query, key, value, lo: int, hi: int) -> torch.Tensor:
    groups = HEADS // KV_HEADS
    keys = key[:, :, :hi].float().repeat_interleave(groups, dim=1)
    values = value[:, :, :hi].float().repeat_interleave(groups, dim=1)
    mask = torch.arange(hi)[None, :] <= torch.arange(lo, hi)[:, None]
    out = F.scaled_dot_product_attention(query[:, :, lo:hi].float(), keys, values, attn_mask=mask)
    return out.transpose(1, 2)


# bfloat16: the tile partial sums are rounded to bfloat16 before the fold, so the
# largest error is ~4x torch's own bfloat16 attention's (0.03 against 0.008 here);
# the model's next-token loss does not see it (docs/benchmarks.md, session 15).
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize(("lo", "hi"), [(0, 48), (0, 300), (250, 300), (640, 656), (600, 1000)])
def test_close_to_torch_attention(dtype, tolerance, lo, hi):
    query, key, value = _inputs(1000, dtype)
    got = _canonical(query, key, value, lo, hi)
    assert got.shape == (1, hi - lo, HEADS, DIM) and got.dtype == dtype
    error = (got.float() - _reference(query, key, value, lo, hi)).abs()
    assert error.max() < tolerance and error.mean() < tolerance / 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_in_any_chunk(dtype, monkeypatch):
    """A row's result does not depend on the rows sharing its call, on how many keys
    follow it, nor on the call being split into query blocks."""
    query, key, value = _inputs(900, dtype, seed=1)
    whole = _canonical(query, key, value, 700, 900)
    for lo in range(700, 900, 16):
        alone = _canonical(query, key, value, lo, lo + 16)
        assert torch.equal(alone, whole[:, lo - 700:lo - 684])
    longer = _canonical(query, key, value, 500, 900)
    assert torch.equal(longer[:, 200:], whole)
    monkeypatch.setattr(attention, "SCORE_BYTES", 1)  # blocks of 16 query rows
    assert torch.equal(_canonical(query, key, value, 700, 900), whole)
