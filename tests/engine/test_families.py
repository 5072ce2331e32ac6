"""Every model family: window, recurrent, convolution, hybrid and expert layers.

Tiny random models of each family's real transformers config (families.py),
through the real engine: the kinds read from the config, cold against hit
bit for bit at odd offsets, the disk tier in another process, batched
decoding against alone, and a fork continuing warm.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtrace.engine import (
    DecodeBatcher,
    Engine,
    GenerateOptions,
    KVCache,
    LayerKind,
    StateCache,
    generate,
    load_engine,
    open_cache,
    prefill,
)
from kvtrace.engine.families import FAMILIES, write_family
from kvtrace.engine.memo import YES_NO
from kvtrace.errors import UnsupportedModelError, UsageError

BLOCK = 16
STATE_FAMILIES = [name for name in FAMILIES if name not in ("qwen3_moe", "olmoe")]
# The kinds each family's config gives (layers.py), in layer order.
EXPECTED_KINDS = {
    "gemma3": {LayerKind.WINDOW, LayerKind.FULL},
    "gpt_oss": {LayerKind.WINDOW, LayerKind.FULL},
    "mistral": {LayerKind.WINDOW},
    "jamba": {LayerKind.STATE, LayerKind.FULL},
    "bamba": {LayerKind.STATE, LayerKind.FULL},
    "falcon_h1": {LayerKind.FULL_STATE},
    "granite_moe_hybrid": {LayerKind.STATE, LayerKind.FULL},
    "qwen3_next": {LayerKind.STATE, LayerKind.FULL},
    "lfm2": {LayerKind.STATE, LayerKind.FULL},
    "mamba2": {LayerKind.STATE},
    "mamba": {LayerKind.STATE},
    "rwkv": {LayerKind.STATE},
    "qwen3_moe": {LayerKind.FULL},
    "olmoe": {LayerKind.FULL},
}


@pytest.fixture(scope="session")
def family_root(engine_root) -> Path:
    return engine_root / "families"


@pytest.fixture(scope="session")
def family_engine(family_root, tokenizer_dir):
    engines: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in engines:
            folder = write_family(name, family_root / name, tokenizer_dir=tokenizer_dir, seed=3)
            engines[name] = load_engine(folder, cache_dir=family_root / "cache")
        return engines[name]

    return get


def test_a_state_model_computes_on_a_fixed_thread_count_its_fingerprint_names(
        family_root, tokenizer_dir, tiny_folder, tmp_path, monkeypatch):
    """The thread probe checks the linear products only; a state or window model's own kernels
    run beside them (a tiny Mamba can give other prefill bits on one thread than on two,
    docs/cache.md), so loading one stops the count from following the load, and its
    fingerprint names the count (KV another count computed must not serve it). A plain model
    whose products keep their bits on every count keeps following the load."""
    from kvtrace.engine import model as model_module
    from kvtrace.engine.threads import ThreadBudget

    budgets: list[ThreadBudget] = []

    def load(folder: Path, most: int) -> tuple[Engine, ThreadBudget]:
        budget = ThreadBudget(most=most)  # the process's own budget, held, would stay held
        budgets.append(budget)
        monkeypatch.setattr(model_module, "engine_threads", lambda: budget)
        return load_engine(folder, cache_dir=tmp_path / f"cache-{most}"), budget

    try:
        folder = write_family("mamba", family_root / "mamba-threads",
                              tokenizer_dir=tokenizer_dir, seed=3)
        mamba, budget = load(folder, 2)
        if budget.why_fixed is not None and "KVTRACE_THREADS" in budget.why_fixed:
            pytest.skip("the thread count is fixed here already (KVTRACE_THREADS)")
        assert not mamba.layout.is_plain and not budget.adapts
        assert "bits may differ on other thread counts" in budget.describe()
        assert load(folder, 1)[0].fingerprint != mamba.fingerprint

        plain, budget = load(tiny_folder, 2)
        invariant = plain.probes.answer("threads", lambda: pytest.fail("never asked"), YES_NO)
        assert budget.adapts is invariant
    finally:
        for budget in budgets:
            budget.hold("the test is over")  # its sampler thread stops


@pytest.mark.parametrize("name", list(FAMILIES))
def test_layer_kinds_come_from_the_config(family_engine, name):
    engine = family_engine(name)
    assert set(engine.layout.kinds()) == EXPECTED_KINDS[name]
    assert isinstance(open_cache(engine), KVCache if engine.layout.is_plain else StateCache)
    for layer in engine.layout.layers:
        assert (layer.window is not None) == layer.kind.is_windowed
        assert (layer.state_bytes > 0) == layer.kind.has_state
        assert (layer.kv_bytes_per_token > 0) == layer.kind.has_kv


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("offset", [17, 63, 64, 100])
def test_hit_is_bit_identical_to_cold(family_engine, tokens, name, offset):
    engine = family_engine(name)
    prompt = tokens(150, seed=1)
    cache = open_cache(engine, block_size=BLOCK)
    # An earlier call whose prompt was the first `offset` tokens, and a sibling parting there.
    prefill(engine, cache, prompt[:offset])
    prefill(engine, cache, prompt[:offset] + tokens(30, seed=2))

    hot = prefill(engine, cache, prompt)
    cold = prefill(engine, None, prompt, block_size=BLOCK)

    resume = offset if engine.layout.is_plain else offset - offset % BLOCK
    assert hot.num_cached_tokens == resume
    assert hot.num_computed_tokens == len(prompt) - resume
    assert torch.equal(hot.logits, cold.logits)


@pytest.mark.parametrize("name", STATE_FAMILIES)
def test_decoding_after_a_hit_gives_the_cold_tokens(family_engine, tokens, name):
    engine = family_engine(name)
    prompt = tokens(90, seed=4)
    cache = open_cache(engine, block_size=BLOCK)
    prefill(engine, cache, prompt[:70])
    warm = generate(engine, cache, prompt, max_new_tokens=6, stop_ids=())
    cold = generate(engine, None, prompt, max_new_tokens=6, stop_ids=())
    assert warm.prefill.num_cached_tokens == 64
    assert warm.token_ids == cold.token_ids


def test_resume_parts_are_kept_where_sequences_end_not_where_prompts_pass(family_engine,
                                                                         tokens):
    """A boundary a prompt passes through keeps its rows only; the last boundary of each
    stored sequence keeps its states (and the window rows before it)."""
    engine = family_engine("qwen3_next")
    cache = open_cache(engine, block_size=BLOCK)
    prompt = tokens(100, seed=9)  # last boundary: 96
    prefill(engine, cache, prompt)
    parted_at_40 = [*prompt[:40], *tokens(20, seed=10)]
    assert prefill(engine, cache, parted_at_40).num_cached_tokens == 0  # 32 was passed
    longer = [*prompt, *tokens(20, seed=11)]
    assert prefill(engine, cache, longer).num_cached_tokens == 96
    assert isinstance(cache, StateCache)
    resume_parts = len(cache.block_states()) - cache.memory_stats().num_entries
    assert resume_parts == 3  # 96, and 48 and 112 (60 and 120 tokens' last boundaries)


def test_a_window_cache_keeps_only_the_window(family_engine, tokens):
    engine = family_engine("mistral")  # every layer a 48-token window
    window = engine.layout.layers[0].window
    assert window is not None
    result = prefill(engine, None, tokens(200, seed=5), block_size=BLOCK)
    for layer in result.kv.cache.layers:  # type: ignore[union-attr]
        assert layer.keys.shape[2] == window - 1


def test_state_layers_hold_the_same_bytes_at_any_length(family_engine, tokens):
    engine = family_engine("mamba2")
    short = prefill(engine, None, tokens(20, seed=6), block_size=BLOCK).kv
    long = prefill(engine, None, tokens(300, seed=6), block_size=BLOCK).kv
    assert short is not None and long is not None
    small = [t.numel() for layer in short.cache.layers for t in layer.recurrent_states.values()]
    large = [t.numel() for layer in long.cache.layers for t in layer.recurrent_states.values()]
    assert small == large and all(small)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_disk_tier_serves_another_process_bit_identically(family_engine, family_root, tmp_path,
                                                           tokens, name):
    engine = family_engine(name)
    prompt = tokens(120, seed=7)
    disk = tmp_path / "kv"
    prefill(engine, open_cache(engine, disk_dir=disk, block_size=BLOCK), prompt[:100])
    script = textwrap.dedent(f"""
        import json, torch
        from kvtrace.engine import load_engine, open_cache, prefill
        engine = load_engine({str(engine.path)!r}, cache_dir={str(family_root / "cache")!r})
        hot = prefill(engine, open_cache(engine, disk_dir={str(disk)!r}, block_size={BLOCK}),
                      {prompt!r})
        torch.save(hot.logits, {str(tmp_path / "logits.pt")!r})
        print(json.dumps([hot.num_memory_tokens, hot.num_disk_tokens]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={**_env(), "HF_HUB_OFFLINE": "1"})
    memory, disk_tokens = json.loads(out.stdout.strip().splitlines()[-1])
    cold = prefill(engine, None, prompt, block_size=BLOCK)
    assert (memory, disk_tokens) == (0, 96)
    assert torch.equal(torch.load(tmp_path / "logits.pt"), cold.logits)


def test_a_damaged_state_block_is_recomputed_not_used(family_engine, tmp_path, tokens):
    engine = family_engine("bamba")
    prompt = tokens(80, seed=8)
    disk = tmp_path / "kv"
    prefill(engine, open_cache(engine, disk_dir=disk, block_size=BLOCK), prompt)
    files = sorted(disk.glob("*/*.safetensors"))
    assert len(files) == 6  # five blocks of rows, the resume part where the prompt ends
    for path in files:
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0xFF  # a flipped bit in the last tensor
        path.write_bytes(bytes(raw))
    fresh = open_cache(engine, disk_dir=disk, block_size=BLOCK)
    longer = [*prompt, *tokens(10, seed=9)]  # the next call: it would resume at 80
    hot = prefill(engine, fresh, longer)
    assert hot.num_cached_tokens == 0
    assert fresh.take_disk_faults().num_damaged >= 1
    assert torch.equal(hot.logits, prefill(engine, None, longer, block_size=BLOCK).logits)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_batched_decoding_gives_each_request_what_it_gets_alone(family_engine, tokens, name):
    engine = family_engine(name)
    prompts = [tokens(40 + 9 * i, seed=20 + i) for i in range(3)]
    alone = [generate(engine, open_cache(engine), p, max_new_tokens=5, stop_ids=(),
                      padded_decode=True) for p in prompts]
    batcher = DecodeBatcher(engine, open_cache(engine))
    try:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            together = list(pool.map(
                lambda p: batcher.generate(p, GenerateOptions(max_new_tokens=5, stop_ids=())),
                prompts))
    finally:
        batcher.close()
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_fork_continues_warm_from_its_parent(family_engine, tokens, name):
    """An agent's two calls, then a fork of the second with its last message edited: the
    fork resumes where the first call's sequence ended (a kept resume point; any token on
    the radix path) and decodes what a cold run decodes."""
    engine = family_engine(name)
    cache = open_cache(engine, block_size=BLOCK)
    first_prompt = tokens(100, seed=30)
    first = generate(engine, cache, first_prompt, max_new_tokens=4, stop_ids=())
    history = [*first_prompt, *first.token_ids]  # 104 tokens: resumable at 96
    generate(engine, cache, [*history, *tokens(30, seed=31)], max_new_tokens=4, stop_ids=())
    fork = [*history, *tokens(25, seed=32)]
    warm = generate(engine, cache, fork, max_new_tokens=4, stop_ids=())
    assert warm.prefill.num_cached_tokens == (104 if engine.layout.is_plain else 96)
    assert warm.token_ids == generate(engine, None, fork, max_new_tokens=4, stop_ids=()).token_ids


def test_a_state_model_refuses_the_radix_cache(family_engine):
    engine = family_engine("lfm2")
    with pytest.raises(UsageError, match="StateCache"):
        prefill(engine, KVCache(engine), [5, 6, 7])


def test_an_encoder_decoder_model_is_refused_in_one_line_naming_the_field(tmp_path,
                                                                           tokenizer_dir):
    from transformers import AutoTokenizer, T5Config

    folder = tmp_path / "t5"
    folder.mkdir()
    T5Config(vocab_size=128, d_model=32, d_ff=64, num_layers=1, num_heads=2,
             d_kv=16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(folder)
    with pytest.raises(UnsupportedModelError) as caught:
        load_engine(folder, cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert "is_encoder_decoder" in message and "\n" not in message


def test_cache_size_per_kind_follows_the_formula(family_engine):
    from kvtrace.engine.maintenance import cache_size

    engine = family_engine("gemma3")
    small, large = cache_size(engine, 1_000), cache_size(engine, 32_768)
    by_kind = {k.kind: k for k in large.kinds}
    full, window = by_kind[str(LayerKind.FULL)], by_kind[str(LayerKind.WINDOW)]
    assert full.num_bytes == full.kv_bytes_per_token * 32_768
    assert window.num_bytes == window.kv_bytes_per_token * (window.window - 1)
    assert {k.kind: k.num_bytes for k in small.kinds}[str(LayerKind.WINDOW)] == window.num_bytes
    mamba = family_engine("mamba2")
    assert cache_size(mamba, 10).num_bytes == cache_size(mamba, 100_000).num_bytes > 0


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


@pytest.mark.parametrize("name", STATE_FAMILIES)
def test_block_chunks_compute_what_one_forward_computes(family_engine, tokens, name):
    """Bit-identical is not enough: the chunked prefill must be right, i.e. carry each
    recurrent state across its forwards (Mamba 1 and Jamba need one token per forward)."""
    engine = family_engine(name)
    prompt = tokens(70, seed=40)
    ours = prefill(engine, None, prompt, block_size=BLOCK).logits
    with torch.inference_mode():
        whole = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    assert torch.allclose(ours, whole, rtol=1e-4, atol=1e-4 * float(whole.abs().max()))


def test_a_long_prompt_costs_window_and_state_layers_what_they_hold(family_engine, tokens):
    """4,096 tokens through a window model and a recurrent model: the tiers keep each
    block's full-attention rows, but window rows and states only where the prompt ends."""
    for name in ("mistral", "mamba2"):
        engine = family_engine(name)
        cache = open_cache(engine)  # 64-token blocks
        prefill(engine, cache, tokens(4096, seed=50))
        assert isinstance(cache, StateCache)
        held = sum(state.num_bytes for state in cache.block_states())
        window = max((layer.window or 0) for layer in engine.layout.layers)
        points = 4096 // (cache.checkpoint_blocks * 64)  # checkpoints, the end among them
        bound = points * sum(layer.kv_bytes_per_token * (window + 64) + layer.state_bytes
                             for layer in engine.layout.layers)
        # Not 4,096 tokens' worth of window rows, nor a state per block.
        every_block = 4096 * engine.kv_bytes_per_token + 64 * sum(
            layer.state_bytes for layer in engine.layout.layers)
        assert 0 < held <= bound < every_block / 3


def test_cache_size_on_the_command_line(family_engine):
    engine = family_engine("gemma3")
    ok = subprocess.run([sys.executable, "-m", "kvtrace", "cache", "size", str(engine.path),
                         "--tokens", "32768", "--json"], capture_output=True, text=True,
                        env={**_env(), "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert ok.returncode == 0, ok.stderr
    sizes = json.loads(ok.stdout)
    window = next(k for k in sizes["kinds"] if k["kind"] == str(LayerKind.WINDOW))
    assert window["num_bytes"] == window["kv_bytes_per_token"] * (window["window"] - 1)
    bad = subprocess.run([sys.executable, "-m", "kvtrace", "cache", "size", str(engine.path),
                          "--tokens", "-5"], capture_output=True, text=True,
                         env={**_env(), "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--tokens" in bad.stderr


@pytest.mark.parametrize(("name", "checked"), [("lfm2", 3), ("mamba2", 1)])
def test_cache_verify_recomputes_state_blocks(family_engine, tmp_path, tokens, name, checked):
    """Rows and resume parts against a cold computation; a recurrent model's block that
    a prompt passed through holds nothing to compare, and is not counted as checked."""
    from kvtrace.engine.maintenance import verify_blocks

    engine = family_engine(name)
    prefill(engine, open_cache(engine, disk_dir=tmp_path / "kv"), tokens(200, seed=60))
    report = verify_blocks(engine, tmp_path / "kv", sample=None)
    assert (report.num_checked, report.mismatched, report.unreadable) == (checked, (), ())
    resume = next(p for p in (tmp_path / "kv").glob("*/*.safetensors")
                  if _part(p) == "resume")
    raw = bytearray(resume.read_bytes())
    raw[-2] ^= 0x01
    resume.write_bytes(bytes(raw))
    damaged = verify_blocks(engine, tmp_path / "kv", sample=None)
    assert (damaged.num_checked, len(damaged.unreadable)) == (checked - 1, 1)


def test_memory_eviction_takes_tails_before_their_ancestors(family_engine, tokens):
    """A prompt longer than the memory budget: its own tail goes first, and an earlier
    call's resume point on its path (an ancestor, used again) stays."""
    engine = family_engine("qwen3_next")
    cache = open_cache(engine, block_size=BLOCK, memory_bytes=60_000)
    long = tokens(400, seed=61)
    prefill(engine, cache, long[:48])  # an earlier call: resumable at 48
    prefill(engine, cache, long)  # 25 blocks, over the budget
    assert 0 < cache.memory_stats().num_bytes <= 60_000
    assert cache.memory_stats().num_entries < 25
    assert prefill(engine, cache, [*long[:48], 7]).num_memory_tokens == 48
    # Its own end (a resume point at 400) went first: it resumes at the earlier call's.
    assert prefill(engine, cache, [*long, 7]).num_cached_tokens == 48


def _part(path: Path) -> str:
    from kvtrace.engine.disk import _read_metadata

    return (_read_metadata(path) or {}).get("part", "rows")


@pytest.mark.parametrize("name", ["qwen3_next", "gemma3"])
def test_a_fork_inside_a_long_prompt_resumes_at_the_last_checkpoint(family_engine, tokens,
                                                                     name):
    """One long prompt, then a fork parting 44 tokens past its first checkpoint: it resumes
    at the checkpoint, not from the start."""
    engine = family_engine(name)
    cache = open_cache(engine, block_size=BLOCK)
    assert isinstance(cache, StateCache)
    every = cache.checkpoint_blocks * BLOCK
    prompt = tokens(every + 344, seed=70)
    prefill(engine, cache, prompt)
    fork = [*prompt[: every + 44], *tokens(40, seed=71)]
    hot = prefill(engine, cache, fork)
    assert hot.num_cached_tokens == every
    assert torch.equal(hot.logits, prefill(engine, None, fork, block_size=BLOCK).logits)
