"""The canonical attention computes attention: close to torch's own, row by row exact.

The parity tests (test_parity.py) prove a cached row gets a cold run's bits
through whole models; these check the function itself against
`scaled_dot_product_attention`, whose sums run in another order, so the two
agree to rounding, not bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvtrace.engine import attention, kernel_probes

HEADS, KV_HEADS, DIM = 6, 2, 64


def _inputs(kv_len: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, HEADS, kv_len, DIM, generator=generator) * 2
    key = torch.randn(1, KV_HEADS, kv_len, DIM, generator=generator)
    value = torch.randn(1, KV_HEADS, kv_len, DIM, generator=generator)
    return query.to(dtype), key.to(dtype), value.to(dtype)


class _Layer(torch.nn.Module):
    """An attention layer as canonical_attention sees one: its config says the kernel."""

    def __init__(self, kernel: str | None) -> None:
        super().__init__()
        self.config = SimpleNamespace(**{attention.KERNEL_ATTR: kernel})


KERNELS = [None, attention.FLASH]  # the tiles, torch's fused kernel (`flash_attention`)


def _canonical(query, key, value, lo: int, hi: int, kernel: str | None = None) -> torch.Tensor:
    """Queries lo..hi-1 over keys 0..hi-1, as a prefill chunk computes them: [b, q, heads, dim]."""
    with torch.inference_mode():  # as in a forward (its scratch buffers are inference tensors)
        out, _ = attention.canonical_attention(
            _Layer(kernel), query[:, :, lo:hi].contiguous(), key[:, :, :hi].contiguous(),
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
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize(("lo", "hi"), [(0, 48), (0, 300), (250, 300), (640, 656), (600, 1000)])
def test_close_to_torch_attention(dtype, tolerance, lo, hi, kernel):
    query, key, value = _inputs(1000, dtype)
    got = _canonical(query, key, value, lo, hi, kernel)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernel_keeps_a_rows_bits_where_its_probe_says_so(dtype):
    """Where `flash_rows_hold` says so on this machine, a row gets the same bits from
    `flash_attention` in any chunk and at any length past it; the engine then takes it (and only
    then: its probe is what stands between a torch whose kernel splits otherwise and a
    cache hit with other bits)."""
    if not kernel_probes.flash_rows_hold(HEADS, KV_HEADS, DIM, dtype, torch.device("cpu")):
        pytest.skip("torch's fused kernel gives other bits by chunk here: the tiles are used")
    query, key, value = _inputs(1300, dtype, seed=2)
    whole = _canonical(query, key, value, 1000, 1300, attention.FLASH)
    for lo in range(1000, 1300, 48):
        alone = _canonical(query, key, value, lo, lo + 16, attention.FLASH)
        assert torch.equal(alone, whole[:, lo - 1000:lo - 984])
    longer = _canonical(query, key, value, 0, 1300, attention.FLASH)  # three key blocks
    assert torch.equal(longer[:, 1000:], whole)


def test_an_engine_takes_the_fused_kernel_where_it_holds_and_is_faster_and_names_it(
        tiny_engine, bf16_engine):
    from kvtrace.engine.attention import FLASH_BLOCK
    from kvtrace.engine.memo import YES_NO

    for engine in (tiny_engine, bf16_engine):
        config = engine.model.config
        holds = kernel_probes.flash_rows_hold(
            config.num_attention_heads, engine.num_kv_heads, engine.head_dim, engine.dtype,
            engine.device)
        # the load's own answer (measured once, so a noisy second timing cannot disagree)
        faster = holds and engine.probes.answer(
            "flash_faster", lambda: pytest.fail("the load never asked"), YES_NO)
        assert engine.attn_implementation.endswith(f":flash-{FLASH_BLOCK}") == faster
        assert (getattr(config, attention.KERNEL_ATTR, None) == attention.FLASH) == faster


@pytest.mark.parametrize("faster", [True, False])
def test_the_faster_kernel_is_taken_with_a_fingerprint_of_its_own(tiny_folder, tmp_path,
                                                                  monkeypatch, faster):
    """Where both keep a row's bits, the measured speed decides (on one machine the fused
    kernel, on another the tiles), and the fingerprint follows: other bits, other KV."""
    from kvtrace.engine import load_engine
    from kvtrace.engine import model as model_module

    monkeypatch.setattr(model_module, "flash_rows_hold", lambda *args: True)
    monkeypatch.setattr(model_module, "flash_is_faster", lambda *args: faster)
    engine = load_engine(tiny_folder, cache_dir=tmp_path / "a")
    assert ("flash" in engine.attn_implementation) is faster
    monkeypatch.setattr(model_module, "flash_is_faster", lambda *args: not faster)
    other = load_engine(tiny_folder, cache_dir=tmp_path / "b")
    assert ("flash" in other.attn_implementation) is (not faster)
    assert other.fingerprint != engine.fingerprint


@pytest.mark.parametrize("slowed", ["tiled_attention", "flash_attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_speed_probe_times_both_kernels_on_the_models_shape(dtype, slowed, monkeypatch):
    """Both kernels run (a call each to warm up, then in turn), and the answer follows their
    times: here made plain by slowing one of them down (the tiles slowed: the fused kernel;
    the fused kernel slowed: the tiles, clearly the faster)."""
    import time

    real = getattr(attention, slowed)
    calls = {"slowed": 0}

    def slow(*args):
        calls["slowed"] += 1
        time.sleep(0.3)  # past either kernel's own time (bfloat16 without native support)
        return real(*args)

    monkeypatch.setattr(attention, slowed, slow)
    faster = kernel_probes.flash_is_faster(HEADS, KV_HEADS, DIM, dtype, torch.device("cpu"))
    assert faster is (slowed == "tiled_attention")
    assert calls["slowed"] == 1 + kernel_probes._SPEED_TRIALS


def test_near_parity_the_speed_probe_keeps_the_fused_kernel():
    """The kernel decides the bits: two processes measuring apart (another cache folder)
    should agree, or the second misses the KV the first left on disk. Only tiles clearly the
    faster replace the fused kernel."""
    clear = kernel_probes.TILES_CLEARLY_FASTER
    assert kernel_probes.prefers_flash(1.0, 1.0)
    assert kernel_probes.prefers_flash(1.0, 1.1) and kernel_probes.prefers_flash(1.1, 1.0)
    assert kernel_probes.prefers_flash(1.0, clear + 0.05)
    assert not kernel_probes.prefers_flash(1.0, clear - 0.05)
    assert not kernel_probes.prefers_flash(1.5, 1.0)  # the bfloat16 EPYC's shape (docs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_read_in_place_from_a_layers_buffer_give_the_bits_of_zero_padding(dtype):
    """`flash_attention` reads a `GrowingLayer`'s keys padded in place: the rows past the
    length (zeros at first, then rows of a longer past cropped away) change no bit of any
    query row."""
    from kvtrace.engine.kvbuffer import GrowingLayer

    query, key, value = _inputs(1300, dtype, seed=3)
    scale = DIM**-0.5
    layer = GrowingLayer()
    with torch.inference_mode():
        layer.update(key, value)
        for length, lo in ((1300, 1250), (900, 880), (200, 150)):  # crops leave stale rows
            layer.crop(length - layer.get_seq_length())
            in_place = layer.padded(attention.FLASH_BLOCK)
            assert in_place is not None
            assert in_place[0].shape[2] == -(-length // attention.FLASH_BLOCK) * 512
            assert in_place[0].data_ptr() == layer.keys.data_ptr()
            if length < 1300:
                stale = in_place[0][:, :, length:]
                assert not torch.equal(stale, torch.zeros_like(stale))
            rows = query[:, :, lo:length]
            got = attention.flash_attention(rows, layer.keys, layer.values, scale, in_place)
            copied = attention.flash_attention(rows, key[:, :, :length].contiguous(),
                                      value[:, :, :length].contiguous(), scale)
            assert torch.equal(got, copied)


def test_a_prefill_reads_its_layers_keys_in_place(tiny_engine, tokens, monkeypatch):
    """Where the engine takes the fused kernel, every attention call of a long prefill, cold
    or extending a cached prefix, gets its keys from the cache's own buffer (no copy), and
    the result is the one copies into scratch give."""
    from kvtrace.engine import KVCache, prefill

    config = tiny_engine.model.config
    if not kernel_probes.flash_rows_hold(config.num_attention_heads, tiny_engine.num_kv_heads,
                                         tiny_engine.head_dim, tiny_engine.dtype,
                                         tiny_engine.device):
        pytest.skip("the fused kernel does not hold here: the tiles are used")
    # As where it is also the faster (the engine's choice may be the tiles: kernel_probes.py).
    monkeypatch.setattr(config, attention.KERNEL_ATTR, attention.FLASH, raising=False)
    real_sdpa, real_flash = F.scaled_dot_product_attention, attention.flash_attention
    calls: list[tuple[int | None, int]] = []  # (the buffer's keys, the keys the kernel read)

    def flash(query, key, value, scale, in_place=None):
        calls.append((None if in_place is None else in_place[0].data_ptr(), -1))
        return real_flash(query, key, value, scale, in_place)

    def sdpa(query, key, value, **kwargs):
        calls[-1] = (calls[-1][0], key.data_ptr())
        return real_sdpa(query, key, value, **kwargs)

    def run():
        cache = KVCache(tiny_engine)
        ids = tokens(1500)  # long: whole flash blocks (kvbuffer.py); each call extends the last
        return [prefill(tiny_engine, cache, ids[:n]) for n in (1200, 1300, 1500)]

    monkeypatch.setattr(attention, "flash_attention", flash)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    in_place = run()
    assert calls and all(buffer is not None and read == buffer for buffer, read in calls)
    monkeypatch.setattr(attention, "_padded_in_place", lambda *args: None)
    calls.clear()
    copied = run()
    assert calls and all(buffer is None for buffer, _ in calls)
    for a, b in zip(in_place, copied, strict=True):
        assert torch.equal(a.logits, b.logits)
