"""`kvtrace bench decode` on a tiny model (figures, not speed), and the decode bound it prints."""

from __future__ import annotations

import pytest

from kvtrace.bench.decode import run_decode_bench
from kvtrace.bench.limits import decode_bound_s
from kvtrace.engine import load_engine
from kvtrace.engine import model as model_module
from kvtrace.errors import UsageError


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_bench_reports_steps_alone_and_batched_beside_the_bound(tiny_folder, tmp_path,
                                                                           dtype):
    figures = run_decode_bench(cache_dir=tmp_path, model=str(tiny_folder), dtype=dtype,
                               num_tokens=200, num_new=6, batch=3, trials=2)
    assert figures["dtype"] == dtype and figures["new_tokens"] == 6 and figures["batch"] == 3
    assert len(figures["step_ms_trials"]) == len(figures["batch_step_ms_trials"]) == 2
    assert figures["step_ms"] == min(figures["step_ms_trials"]) > 0
    assert figures["batch_step_ms"] == min(figures["batch_step_ms_trials"]) > 0
    assert figures["batched_row_equals_alone"] is True
    if dtype == "float32":
        assert figures["packed_linears"] == 0  # packed.py packs bfloat16 only
    bound = figures["bound"]
    assert bound["bandwidth_gb_s"] > 0 and bound["decode_step_bound_ms"] > 0
    assert bound["step_over_bound"] == pytest.approx(  # of the unrounded figures
        figures["step_ms"] / bound["decode_step_bound_ms"], rel=0.1)


def test_bad_figures_are_refused_before_anything_loads(tmp_path):
    with pytest.raises(UsageError, match="--new"):
        run_decode_bench(cache_dir=tmp_path, model=str(tmp_path / "no-model"), num_new=1)


def test_a_step_reads_every_weight_once_and_one_row_of_the_embeddings(tiny_folder, tmp_path,
                                                                      monkeypatch):
    """The tied output layer counts once whether it shares the embeddings' weight (dense) or
    holds a packed copy of its own, and the embeddings are not read whole."""
    packed = load_engine(tiny_folder, cache_dir=tmp_path / "a", dtype="bfloat16")
    monkeypatch.setattr(model_module, "can_pack", lambda dtype, device: False)
    dense = load_engine(tiny_folder, cache_dir=tmp_path / "b", dtype="bfloat16")
    model = dense.model
    embeddings = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embeddings  # the tiny model ties them
    others = sum(p.numel() for p in model.parameters() if p is not embeddings)
    expected = (others + embeddings.numel()) * 2  # bfloat16; the output layer reads them
    assert decode_bound_s(dense, 1.0) == expected
    assert decode_bound_s(packed, 1.0) == expected
