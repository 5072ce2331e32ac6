"""`record --from RUN@K --n K`: K copies of an unchanged agent at once, from one fork point.

The agent is examples/fork_agent.py, sampling (temperature 0.8, no seed sent),
run as K separate processes against one real server on loopback (one
engine, one batcher), each in its own working folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtrace.store import ModelCall, StepKind

AGENT = Path(__file__).resolve().parents[2] / "examples" / "fork_agent.py"
SAMPLED = [sys.executable, str(AGENT), "--temperature", "0.8"]


def model_calls(store, run: str) -> list[Any]:
    return [s for s in store.path(run) if s.kind == StepKind.MODEL_CALL]


@pytest.fixture
def sampled_base(store, serve_local, tiny_engine, tmp_path) -> Any:
    """A four-call sampled run `base` of the agent (the server chose and recorded its seeds)."""
    server = serve_local(store, run="base")
    env = {**os.environ, "OPENAI_BASE_URL": server.url, "OPENAI_API_KEY": "sk-test"}
    subprocess.run([*SAMPLED, "--calls", "4", "--model", tiny_engine.name, "--folder",
                    str(tmp_path / "base")], env=env, check=True, timeout=600,
                   capture_output=True)
    server.stop()
    assert len(model_calls(store, "base")) == 4
    return store


def _live_outputs(store, run: str) -> list[list[int] | None]:
    return [ModelCall(s).output_ids for s in model_calls(store, run)[2:]]


def test_k_agents_fork_at_one_step_each_on_its_fork_with_its_seed_and_folder(
        sampled_base, serve_started, tiny_engine, tmp_path):
    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve.agents import make_agents
    from kvtrace.serve.experiment import ExperimentReport, run_agents
    from kvtrace.serve.fromrun import warm

    store = sampled_base
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine)).batching()
    warm(store, "base@2", backend)
    agents = make_agents(store, "exp", 3, seed=7, workdir=str(tmp_path / "work-{i}"))
    server = serve_started(backend=backend, store=store, from_run="base@2", agents=agents)
    command = [*SAMPLED, "--calls", "4", "--model", tiny_engine.name]
    exits = run_agents(command, agents, server.url)
    report = ExperimentReport.of(store, "base@2", server.server, exits)
    assert [run.exit_code for run in report.runs] == [0, 0, 0]
    base = model_calls(store, "base")
    for index, run in enumerate(report.runs, start=1):
        assert run.agent.fork == f"exp-{index}"
        assert (run.summary.num_served, run.summary.first_live_step) == (2, 3)
        fork = model_calls(store, f"exp-{index}")
        assert [s.id for s in fork[:2]] == [s.id for s in base[:2]] and len(fork) == 4
        # sampled with the agent's seed, recorded as the server's choice
        assert {s.meta["params"]["seed"] for s in fork[2:]} == {7 + index - 1}
        assert all(s.meta["extra"]["seed_chosen"] for s in fork[2:])
        # its own folder: its tool wrote its notes there, all four of them
        notes = (tmp_path / f"work-{index}" / "notes.txt").read_text().splitlines()
        assert len(notes) == 4 and notes[:2] == (tmp_path / "base" / "notes.txt").read_text(
            ).splitlines()[:2]
        assert run.stats is not None and run.stats.calls == 2
    # compared as branch compares: agent 1 is the reference, other seeds part from it
    assert report.runs[0].diverged_at is None
    assert any(run.diverged_at is not None and run.diverged_at > 2 for run in report.runs[1:])
    assert report.prefix_recorded_s > 0 and report.rerun_total_s > report.wall_s
    # Agent 2 alone (its seed, nothing else in flight) gets exactly the tokens it got here.
    [alone] = make_agents(store, "alone", 1, seed=8)
    solo = serve_started(backend=backend, store=store, from_run="base@2", agents=[alone])
    run_agents(command, [alone], solo.url)
    assert _live_outputs(store, "alone-1") == _live_outputs(store, "exp-2")


def test_a_request_of_no_agent_is_a_404(sampled_base, serve_started, tiny_engine):
    import httpx

    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve.agents import make_agents

    store = sampled_base
    agents = make_agents(store, "exp", 2)
    server = serve_started(backend=LocalBackend(tiny_engine, KVCache(tiny_engine)),
                           store=store, from_run="base@2", agents=agents)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    root = server.url.removesuffix("/v1")
    for url in (f"{server.url}/chat/completions", f"{root}/a/3/v1/chat/completions"):
        reply = httpx.post(url, json=body)
        assert reply.status_code == 404 and "2 agents" in reply.json()["error"]["message"]
    assert httpx.get(f"{root}/a/2/health").json()["status"] == "ok"
    assert [info.name for info in store.runs()] == ["base"]


def test_record_n_on_the_command_line(tmp_path, monkeypatch, capfd, tiny_model_folder):
    """`kvtrace record --from RUN@K --n K -- CMD` as a user runs it, bad input included."""
    from kvtrace import open_store
    from kvtrace.cli import main

    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)  # an agent given no folder writes its notes here, not in the repo

    def kv(*argv: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exit_info:
            main(list(argv))
        out, err = capfd.readouterr()
        return int(exit_info.value.code or 0), out, err

    model = ["--model", str(tiny_model_folder)]
    agent = [*SAMPLED, "--calls", "3"]
    code, _, err = kv("record", *model, "--run", "base", "--", *agent, "--folder",
                      str(tmp_path / "a"))
    assert code == 0, err
    code, out, err = kv("record", *model, "--from", "base@2", "--n", "2", "--workdir",
                        str(tmp_path / "w{i}"), "--json", "--", *agent)
    assert code == 0, err
    report = json.loads(out[out.index("{\n"):])  # after the agents' own output
    assert [a["run"] for a in report["agents"]] == ["base-from-2-1", "base-from-2-2"]
    assert [a["seed"] for a in report["agents"]] == [0, 1]
    assert [a["from"]["num_served"] for a in report["agents"]] == [2, 2]
    assert report["rerun_total_s"] > 0 and "recorded" in report["rerun_source"]
    assert (tmp_path / "w1" / "notes.txt").exists() and (tmp_path / "w2" / "notes.txt").exists()
    code, _, err = kv("record", *model, "--from", "base@2", "--n", "2", "--seed", "5", "--",
                      *agent, "--folder", str(tmp_path / "b"))
    assert code == 0, err
    assert "base-from-2-3" in err and "base-from-2-4" in err and "a full re-run of each" in err
    # --workdir without --n: the one program's working folder, made if missing
    code, _, err = kv("record", *model, "--workdir", str(tmp_path / "one" / "here"), "--",
                      sys.executable, "-c", "open('marker', 'w').close()")
    assert code == 0, err
    assert (tmp_path / "one" / "here" / "marker").exists()
    with open_store() as store:
        runs = sorted(info.name for info in store.runs())
    for argv, message in [
        (["--from", "base@2", "--n", "0"], "--n 0"),
        (["--n", "2"], "give --from"),
        (["--from", "base@2", "--n", "2", "--workdir", str(tmp_path / "same")], "{i}"),
        (["--from", "base@2", "--seed", "3"], "--seed"),
        (["--from", "nope@2", "--n", "2"], "nope"),
        (["--workdir", str(tmp_path / "x{i}")], "{i}"),
    ]:
        code, _, err = kv("record", *model, *argv, "--", *agent)
        assert code == 2, err
        assert err.startswith("error:") and message in err and len(err.strip().splitlines()) == 1
    with open_store() as store:
        assert sorted(info.name for info in store.runs()) == runs  # nothing recorded
    assert not (tmp_path / "same").exists() and not (tmp_path / "x{i}").exists()


def test_the_experiments_bench_gets_the_same_tokens_both_ways(tiny_model_folder):
    from kvtrace.bench.experiments import run_experiments_bench

    figures = run_experiments_bench(model=str(tiny_model_folder), n=2, calls=3, k=1,
                                    max_tokens=6, steps=1, trials=1)
    for case in ("agents", "branch"):
        assert figures[case]["same_tokens"] is True, case
        [alone], [together] = figures[case]["one_after_another"], figures[case]["together"]
        assert alone["completion_tokens"] == together["completion_tokens"] > 0, case
        assert alone["max_rows"] == 1 and figures[case]["ratio"] > 0
