"""The probes' answers, remembered in the cache folder (kvtrace/engine/memo.py).

Real loads of a tiny model from its folder, each into a cache folder of the
test's own, and the real `probes.json` those loads read and write.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvtrace.engine import load_engine, memo
from kvtrace.engine.decode import row_multiple
from kvtrace.engine.memo import PROBES_FILE, Probes

# Asked of a full-attention model on the CPU, in this order (`flash_faster` where the fused
# kernel holds, `packed_rows` in bfloat16; the row check runs at every load and is part of
# the key instead)
PROBED_AT_LOAD = ["threads", "flash_rows", "flash_faster", "packed_rows"]


def test_a_second_load_remembers_what_the_first_measured(tiny_folder, tmp_path):
    first = load_engine(tiny_folder, cache_dir=tmp_path)
    multiple = row_multiple(first)  # probed at the first decode, then kept with the rest
    asked = [name for name in PROBED_AT_LOAD if name in first.probes.measured]
    assert "flash_rows" in asked and "rows" not in first.probes.measured
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
    """The memo's answers decide without probing: flipped by hand (what another machine's
    attention kernel could find), the next load takes the other attention, with its own
    fingerprint (other bits, other KV)."""
    measured = load_engine(tiny_folder, cache_dir=tmp_path)
    path = tmp_path / PROBES_FILE
    stored = json.loads(path.read_text())
    answers = stored[measured.probes.key]
    flash = answers["flash_rows"] and answers.get("flash_faster", False)  # asked if it holds
    assert flash is ("flash" in measured.attn_implementation)
    answers["flash_rows"] = answers["flash_faster"] = not flash
    path.write_text(json.dumps(stored))
    told = load_engine(tiny_folder, cache_dir=tmp_path)
    assert "flash_rows" in told.probes.remembered
    assert ("flash" in told.attn_implementation) is (not flash)
    assert told.fingerprint != measured.fingerprint


@pytest.mark.parametrize("stored", [True, 0, 5, "4", None], ids=repr)
def test_a_stored_answer_the_probe_cannot_give_is_measured_again(tiny_folder, tmp_path,
                                                                 stored):
    engine = load_engine(tiny_folder, cache_dir=tmp_path)
    multiple = row_multiple(engine)
    path = tmp_path / PROBES_FILE
    memo = json.loads(path.read_text())
    memo[engine.probes.key]["decode_row_multiple"] = stored
    path.write_text(json.dumps(memo))
    again = load_engine(tiny_folder, cache_dir=tmp_path)
    assert row_multiple(again) == multiple and "decode_row_multiple" in again.probes.measured
    assert json.loads(path.read_text())[again.probes.key]["decode_row_multiple"] == multiple


def test_another_dtype_or_numerics_setting_probes_again(tiny_folder, tmp_path, monkeypatch):
    f32 = load_engine(tiny_folder, cache_dir=tmp_path)
    bf16 = load_engine(tiny_folder, cache_dir=tmp_path, dtype="bfloat16")
    assert bf16.probes.key != f32.probes.key and "flash_rows" in bf16.probes.measured
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # other kernels, maybe other bits
    other = load_engine(tiny_folder, cache_dir=tmp_path)
    assert other.probes.key not in (f32.probes.key, bf16.probes.key)
    assert other.probes.remembered == [] and "flash_rows" in other.probes.measured
    assert len(json.loads((tmp_path / PROBES_FILE).read_text())) == 3


def test_an_unreadable_memo_is_measured_again_and_rewritten(tiny_folder, tmp_path):
    (tmp_path / PROBES_FILE).write_text("{not json")
    engine = load_engine(tiny_folder, cache_dir=tmp_path)
    assert engine.probes.remembered == [] and "flash_rows" in engine.probes.measured
    assert engine.probes.key in json.loads((tmp_path / PROBES_FILE).read_text())


def test_the_key_names_the_model_the_threads_and_the_cpu(tmp_path, monkeypatch):
    parts = {"weights": "w", "dtype": "torch.float32", "rows_invariant": True}
    cpu = torch.device("cpu")

    def key(**changes) -> str | None:
        return Probes.in_cache(tmp_path, {**parts, **changes}, cpu, changes.get("t", 2)).key

    keys = {key(), key(t=1), key(weights="v"), key(rows_invariant=False)}
    monkeypatch.setattr(memo, "_cpu_model", lambda: "another cpu")
    keys.add(key())
    assert len(keys) == 5 and None not in keys
    monkeypatch.setattr(memo, "_cpu_model", lambda: None)  # not Linux: nothing kept
    assert Probes.in_cache(tmp_path, parts, cpu, 2).path is None


def test_an_engine_built_by_hand_keeps_its_answers_in_memory():
    probes = Probes.in_memory()
    runs: list[int] = []

    def probe() -> int:
        runs.append(1)
        return 4 * len(runs)

    assert probes.answer("x", probe, (4, 8)) == 4 and runs == [1]
    assert probes.answer("x", probe, (4, 8)) == 4 and runs == [1]
    assert probes.path is None and probes.measured == ["x"]
