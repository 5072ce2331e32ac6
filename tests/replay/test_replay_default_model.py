"""A few behaviours on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import pytest

from kvtrace.errors import MissingToolError
from kvtrace.replay import SamplingParams, continue_run, replay
from kvtrace.replay.tools import DEMO_TOOLS, demo_messages

pytestmark = pytest.mark.slow

START = demo_messages("Which country is Lima in?")
PARAMS = SamplingParams(max_new_tokens=24)


def test_a_greedy_run_of_the_default_model_verifies_step_for_step(
    replay_store, default_engine, local_backend_factory, tmp_path
):
    recorder = local_backend_factory(default_engine, kv_dir=tmp_path / "rec")
    recorded = continue_run(
        replay_store, "agent", recorder, steps=3, messages=START, tools=DEMO_TOOLS, params=PARAMS
    )
    assert recorded.new_steps[0].kind == "model_call"
    assert any(s.kind == "tool_call" for s in recorded.new_steps)  # the format was followed
    fresh = local_backend_factory(default_engine, kv_dir=tmp_path / "verify")
    report = replay(replay_store, "agent", fresh, mode="verify")
    assert report.is_match is True
    assert [s.reused_tokens for s in report.steps] == [s.oracle_tokens for s in report.steps]
    assert "accepted" in [s.draft for s in report.steps]  # checked in one pass
    decoded = replay(replay_store, "agent", local_backend_factory(
        default_engine, kv_dir=tmp_path / "decode"), mode="verify", use_drafts=False)
    assert decoded.is_match is True


def test_the_default_model_asking_for_an_unregistered_tool_stops_naming_it(
    replay_store, default_engine, local_backend_factory, tmp_path
):
    backend = local_backend_factory(default_engine, kv_dir=tmp_path / "kv")
    with pytest.raises(MissingToolError, match="'lookup'"):
        continue_run(
            replay_store,
            "agent",
            backend,
            steps=2,
            messages=START,
            tools={"calculator": DEMO_TOOLS["calculator"]},
            params=PARAMS,
        )
