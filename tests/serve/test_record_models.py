"""Several models in one experiment: `record --from RUN@K --n K --models A,B` (issue 43, item 5).

Locally, two tiny random models (two engines, each its own cache and
batcher): agents 1 and 3 are answered by A, agent 2 by B, the recorded
prefix by the recording whatever the model; the report groups by model.
Upstream, each agent's live requests reach the upstream naming its model.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from kvtrace.cli import main
from kvtrace.store import ModelCall, StepKind, open_store

AGENT = Path(__file__).resolve().parents[2] / "examples" / "fork_agent.py"


def _kvtrace(capfd, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out = capfd.readouterr()
    return exit_info.value.code or 0, out.out, out.err


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    return tmp_path


def _live_models(home, fork):
    with open_store(f"sqlite:///{home / 'home' / 'store.db'}", create=False) as store:
        return [ModelCall(s).model for s in store.path(fork)
                if s.kind == StepKind.MODEL_CALL][2:]


def test_k_agents_on_two_local_models_each_answered_by_its_own(
    home, capfd, tiny_model_folder, tiny_model_factory
):
    other = home / "other-tiny"  # a model is named by its folder: the two names differ
    shutil.copytree(tiny_model_factory("other-model", seed=11), other)
    code, _, err = _kvtrace(capfd, "record", "--model", str(tiny_model_folder), "--run", "base",
                            "--workdir", str(home / "base"), "--",
                            sys.executable, str(AGENT), "--calls", "4")
    assert code == 0, err
    code, out, err = _kvtrace(
        capfd, "record", "--from", "base@2", "--n", "3",
        "--models", f"{tiny_model_folder},{other}", "--workdir", str(home / "runs" / "{i}"),
        "--verify", "test -f notes.txt", "--json", "--",
        sys.executable, str(AGENT), "--calls", "4")
    assert code == 0, err
    report = json.loads(out[out.index("{"):])
    names = [agent["model"] for agent in report["agents"]]
    assert names[0] == names[2] != names[1]
    for agent in report["agents"]:
        assert agent["from"]["num_served"] == 2  # the prefix from the recording
        assert set(_live_models(home, agent["run"])) == {agent["model"]}
    groups = {group["model"]: group for group in report["models"]}
    assert groups[names[0]]["agents"] == [1, 3] and groups[names[1]]["agents"] == [2]
    assert groups[names[0]]["passed"] == 2 and groups[names[1]]["graded"] == 1

    code, _, err = _kvtrace(
        capfd, "record", "--from", "base@2", "--n", "2",
        "--models", f"{tiny_model_folder},{other}", "--workdir", str(home / "again" / "{i}"),
        "--", sys.executable, str(AGENT), "--calls", "4")
    assert code == 0, err
    assert "(agents 1): " in err and "(agents 2): " in err and "prompt tokens" in err
    assert "agent i is answered by model (i - 1) mod 2: tiny: agents 1; other-tiny: agents 2" \
        in err


def test_upstream_agents_name_their_models_upstream(home, capfd, canned_upstream):
    code, _, err = _kvtrace(capfd, "record", "--upstream", canned_upstream.url, "--run", "base",
                            "--workdir", str(home / "base"), "--",
                            sys.executable, str(AGENT), "--calls", "3")
    assert code == 0, err
    before = len(canned_upstream.seen)
    code, out, err = _kvtrace(
        capfd, "record", "--upstream", canned_upstream.url, "--from", "base@1", "--n", "2",
        "--models", "model-a,model-b", "--workdir", str(home / "runs" / "{i}"),
        "--workspace", ".", "--verify", "test -f notes.txt", "--json", "--",
        sys.executable, str(AGENT), "--calls", "3")
    assert code == 0, err
    sent = [json.loads(seen["body"])["model"] for seen in canned_upstream.seen[before:]
            if seen.get("body")]
    assert sorted(sent) == ["model-a", "model-a", "model-b", "model-b"]
    report = json.loads(out[out.index("{"):])
    assert [agent["model"] for agent in report["agents"]] == ["model-a", "model-b"]
    assert (report["passed"], report["failed"]) == (2, 0)  # upstream: graded the same way
    with open_store(f"sqlite:///{home / 'home' / 'store.db'}", create=False) as store:
        for agent in report["agents"]:
            live = [s for s in store.path(agent["run"]) if s.kind == StepKind.MODEL_CALL][1:]
            assert live and all(ModelCall(s).workspace for s in live)


@pytest.mark.parametrize("args, says", [
    (["--models", "a,b"], "give --from RUN@K --n K too"),
    (["--from", "base@1", "--n", "2", "--models", "only-one"], "name two or more"),
    (["--from", "base@1", "--n", "2", "--models", "./no/such/a,./no/such/b"],
     "no model folder or GGUF file"),
    (["--from", "base@1", "--n", "2", "--model", "x", "--models", "a,b"], "not both"),
])
def test_bad_models_are_one_line_and_record_nothing(home, capfd, args, says):
    code, _, err = _kvtrace(capfd, "record", *args, "--", sys.executable, str(AGENT))
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1
    store = home / "home" / "store.db"
    if store.exists():
        with open_store(f"sqlite:///{store}", create=False) as opened:
            assert opened.runs() == []
