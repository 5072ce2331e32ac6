"""Branch out: K forks of one step, continued, sharing the prefix's KV (tiny model, SQLite)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtrace.engine import KVCache
from kvtrace.replay import LocalBackend, SamplingParams
from kvtrace.replay.branch import branch_out
from kvtrace.replay.continuation import continue_run
from kvtrace.replay.tools import DEMO_TOOLS, demo_messages
from kvtrace.store import ModelCall


def _recorded(store, engine, tmp_path):
    backend = LocalBackend(engine, KVCache(engine, disk_dir=tmp_path / "kv-record"))
    continue_run(store, "base", backend, steps=2, tools=DEMO_TOOLS,
                 messages=demo_messages("What is 12 times 7?"),
                 params=SamplingParams(max_new_tokens=8))
    return store.path("base")


def test_branch_out_computes_the_shared_prefix_once(store, tiny_engine, tmp_path):
    path = _recorded(store, tiny_engine, tmp_path)
    fresh = LocalBackend(tiny_engine, KVCache(tiny_engine, disk_dir=tmp_path / "kv"))
    report = branch_out(store, "base", fresh, n=4, steps=2, tools=DEMO_TOOLS,
                        params=SamplingParams(temperature=1.0, max_new_tokens=8), seed=5)
    assert [b.run for b in report.branches] == [f"base-branch-{i}" for i in range(1, 5)]
    assert [b.seed for b in report.branches] == [5, 6, 7, 8]
    ids = [s.id for s in path]
    for branch in report.branches:
        steps = store.path(branch.run)
        assert [s.id for s in steps[: len(ids)]] == ids  # the parent's own steps, shared
        assert len(steps) > len(ids)
    computed = sorted(b.result.reports[0].computed_tokens for b in report.branches)
    # The branch whose first prompt was prefilled first computes what follows the
    # checked-out prefix; the other three only the prompt's last token, which is always
    # computed: the prefix was computed once.
    assert computed[:3] == [1, 1, 1] and computed[3] > 1
    assert 0 < report.prefix_computed_tokens <= report.prefix_tokens
    outputs = {b.output for b in report.branches}
    assert len(outputs) > 1  # other seeds, other continuations
    assert any(b.diverged_at is not None for b in report.branches[1:])


def test_branches_decoded_together_get_exactly_what_each_gets_alone(store, tiny_engine,
                                                                     tmp_path):
    _recorded(store, tiny_engine, tmp_path)
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine, disk_dir=tmp_path / "kv")).batching()
    params = SamplingParams(temperature=1.0, max_new_tokens=64)
    together = branch_out(store, "base", backend, n=4, steps=2, tools=DEMO_TOOLS,
                          params=params, seed=5, prefix="together")
    assert backend.batcher is not None and backend.batcher.max_step_rows >= 2  # batched

    def outputs(branch) -> list:
        return [(s.kind, s.content, ModelCall(s).output_ids if s.kind == "model_call" else None)
                for s in branch.result.new_steps]

    for index, branch in enumerate(together.branches):
        alone = branch_out(store, "base", backend, n=1, steps=2, tools=DEMO_TOOLS,
                           params=params, seed=5 + index, prefix=f"alone-{index}")
        assert outputs(alone.branches[0]) == outputs(branch), f"branch {index + 1}"
    assert len({b.output for b in together.branches}) > 1  # four seeds, four continuations


def test_branch_out_from_an_edited_step(store, tiny_engine, tmp_path):
    run = store.run("base")
    run.record_model_call(demo_messages("What is 6 times 7?"),
                          "Action: calculator\nAction Input: 6*7", model="m")
    tool_step = run.record_tool_call("calculator", "6*7", 41)
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine, disk_dir=tmp_path / "kv"))
    report = branch_out(store, tool_step.id, backend, n=2, steps=1, prefix="fixed",
                        tools=DEMO_TOOLS, edit={"result": "42"},
                        params=SamplingParams(temperature=0.0, max_new_tokens=8))
    assert report.fork_step.meta["edit_of"] == tool_step.id
    for branch in report.branches:
        steps = store.path(branch.run)
        assert steps[tool_step.depth - 1].content["result"] == "42"
        call = next(s for s in steps[tool_step.depth:] if s.kind == "model_call")
        assert call.content["messages"][-1]["content"].endswith("42")
    assert report.branches[0].output == report.branches[1].output  # greedy: alike
    assert report.branches[1].diverged_at is None


def test_branch_cli_rejects_bad_input_without_changing_anything(tmp_path):
    env_store = f"sqlite:///{tmp_path / 'store.db'}"
    for args, message in [
        (["branch", "nowhere", "--n", "2"], "error:"),
        (["branch", "x", "--n", "0"], "error:"),
    ]:
        result = subprocess.run([sys.executable, "-m", "kvtrace", "--store", env_store, *args],
                                capture_output=True, text=True)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(message) and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "store.db").exists()  # a refused command creates no store



def test_branch_at_a_final_answer_is_refused_before_any_run_is_made(store, tiny_engine,
                                                                     tmp_path, capsys):
    """Issue 41, item 9: K runs with no new step, which the store could never remove."""
    from kvtrace.cli import main
    from kvtrace.errors import UsageError

    run = store.run("done")
    run.record_model_call([{"role": "user", "content": "Hi?"}], "Final Answer: hello",
                          model="m")
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine))
    before = {r.name for r in store.runs()}
    try:
        branch_out(store, "done", backend, n=3, steps=1, tools=DEMO_TOOLS)
    except UsageError as exc:
        assert "final answer" in str(exc) and "earlier step" in str(exc)
    else:
        raise AssertionError("branch at a final answer made runs")
    assert {r.name for r in store.runs()} == before
    # An edit that calls a tool there is a step to continue from: refused no more.
    edited = {"response": {"role": "assistant",
                           "content": "Action: calculator\nAction Input: 2*3"}}
    report = branch_out(store, "done", backend, n=1, steps=1, tools=DEMO_TOOLS, edit=edited,
                        params=SamplingParams(max_new_tokens=4))
    assert len(store.path(report.branches[0].run)) > len(store.path("done"))
    # The CLI says it in one line, exit 2.
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", store.url, "branch", "done", "--n", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "final answer" in err
    assert {r.name for r in store.runs()} == before | {report.branches[0].run}
