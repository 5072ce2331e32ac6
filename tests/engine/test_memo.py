"""The probes' answers, remembered in the cache folder (kvtrace/engine/memo.py).

Real loads of a tiny model from its folder, each into a cache folder of the
test's own, and the real `probes.json` those loads read and write.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvtrace.engine import load_engine
from kvtrace.engine.decode import row_multiple
from kvtrace.engine.memo import PROBES_FILE, Probes

PROBED_AT_LOAD = ["rows", "threads", "flash_rows"]


def test_a_second_load_remembers_what_the_first_measured(tiny_folder, tmp_path):
    first = load_engine(tiny_folder, cache_dir=tmp_path)
    multiple = row_multiple(first)  # probed at the first decode, then kept with the rest
    # `threads` is asked only where the thread budget adapts (more than one thread)
    asked = [name for name in PROBED_AT_LOAD if name in first.probes.measured]
    assert {"rows", "flash_rows"} <= set(asked)
    assert first.probes.remembered == []
    stored = json.loads((tmp_path / PROBES_FILE).read_text())
    assert list(stored) == [first.probes.key]
    assert stored[first.probes.key]["decode_row_multiple"] == multiple

    second = load_engine(tiny_folder, cache_dir=tmp_path)
    assert second.probes.key == first.probes.key
    assert second.probes.measured == [] and second.probes.remembered == asked
    assert row_multiple(second) == multiple and second.probes.measured == []
    # the answers decide the same engine: same attention, same pinning, same fingerprint
    assert (second.attn_implementation, second.pinned_rows, second.fingerprint) == (
        first.attn_implementation, first.pinned_rows, first.fingerprint)


def test_the_remembered_answer_is_the_one_used(tiny_folder, tmp_path):
    """Where the memo says a row's bits depend on the row count (what a machine whose GEMM
    picks kernels by rows would find), the load believes it without probing: float32 then
    warns that hits may differ from cold runs."""
    measured = load_engine(tiny_folder, cache_dir=tmp_path)
    path = tmp_path / PROBES_FILE
    stored = json.loads(path.read_text())
    assert stored[measured.probes.key]["rows"] is True  # measured here (test_numerics.py)
    stored[measured.probes.key]["rows"] = False
    path.write_text(json.dumps(stored))
    with pytest.warns(UserWarning, match="other bits depending on how many rows"):
        told = load_engine(tiny_folder, cache_dir=tmp_path)
    assert "rows" in told.probes.remembered and "rows" not in told.probes.measured


def test_another_dtype_or_numerics_setting_probes_again(tiny_folder, tmp_path, monkeypatch):
    f32 = load_engine(tiny_folder, cache_dir=tmp_path)
    bf16 = load_engine(tiny_folder, cache_dir=tmp_path, dtype="bfloat16")
    assert bf16.probes.key != f32.probes.key and "rows" in bf16.probes.measured
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # other kernels, maybe other bits
    other = load_engine(tiny_folder, cache_dir=tmp_path)
    assert other.probes.key not in (f32.probes.key, bf16.probes.key)
    assert other.probes.remembered == [] and "rows" in other.probes.measured
    assert len(json.loads((tmp_path / PROBES_FILE).read_text())) == 3


def test_an_unreadable_memo_is_measured_again_and_rewritten(tiny_folder, tmp_path):
    (tmp_path / PROBES_FILE).write_text("{not json")
    engine = load_engine(tiny_folder, cache_dir=tmp_path)
    assert engine.probes.remembered == [] and "rows" in engine.probes.measured
    assert engine.probes.key in json.loads((tmp_path / PROBES_FILE).read_text())


def test_the_key_names_the_threads_and_the_device(tmp_path):
    parts = {"weights": "w", "dtype": "torch.float32"}
    cpu = torch.device("cpu")
    keys = {Probes.in_cache(tmp_path, parts, cpu, 2).key,
            Probes.in_cache(tmp_path, parts, cpu, 1).key,
            Probes.in_cache(tmp_path, {**parts, "weights": "v"}, cpu, 2).key}
    assert len(keys) == 3
    assert Probes.in_cache(tmp_path, parts, cpu, 2).key == Probes.in_cache(
        tmp_path, dict(parts), cpu, 2).key


def test_an_engine_built_by_hand_keeps_its_answers_in_memory():
    probes = Probes.in_memory()
    runs: list[int] = []

    def probe() -> int:
        runs.append(1)
        return 4 * len(runs)

    assert probes.answer("x", probe) == 4 and probes.answer("x", probe) == 4 and runs == [1]
    assert probes.path is None and probes.measured == ["x"]
