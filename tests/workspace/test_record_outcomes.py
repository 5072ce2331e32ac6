"""`record --workspace` and `--verify` on a real openai-SDK agent that writes files (issue 43).

The agent (examples/fork_agent.py) appends each answer to notes.txt in its
folder after every model call, so call k's snapshot holds k - 1 notes.
Restored, each snapshot is the file as it was, byte for byte; `diff
--files` shows the note added; a verify command that runs a real test
file gives a verdict step, and a failing one makes `record` exit 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvtrace.cli import main
from kvtrace.store import ModelCall, StepKind, open_store

AGENT = Path(__file__).resolve().parents[2] / "examples" / "fork_agent.py"
TEST_FILE = """\
from pathlib import Path


def test_three_notes():
    assert len(Path("notes.txt").read_text().splitlines()) == 3
"""


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


def test_record_snapshots_the_folder_before_each_call_and_grades_the_run(
    home, capfd, tiny_model_folder
):
    work = home / "agent"
    work.mkdir()
    (work / "test_notes.py").write_text(TEST_FILE)
    verify = f"{sys.executable} -m pytest -q -p no:cacheprovider test_notes.py"
    code, out, err = _kvtrace(
        capfd, "record", "--model", str(tiny_model_folder), "--run", "base",
        "--workdir", str(work), "--workspace", ".", "--verify", verify, "--json", "--",
        sys.executable, str(AGENT), "--calls", "3")
    assert code == 0, err
    report = json.loads(out[out.index("{"):])
    assert report["verdict"]["passed"] and report["verdict"]["exit_code"] == 0
    assert "1 passed" in report["verdict"]["output"]

    with open_store(f"sqlite:///{home / 'home' / 'store.db'}", create=False) as store:
        path = store.path("base")
        calls = [s for s in path if s.kind == StepKind.MODEL_CALL]
        assert len(calls) == 3 and all(ModelCall(s).workspace for s in calls)
        assert path[-1].kind == "verdict" and path[-1].meta["passed"] is True
        assert len({ModelCall(s).workspace for s in calls}) == 3  # a note more each time

    notes = (work / "notes.txt").read_text().splitlines(keepends=True)
    for k, call in enumerate(calls, start=1):
        out_dir = home / f"restored-{k}"
        code, _, err = _kvtrace(capfd, "workspace", f"base@{call.depth}", "-o", str(out_dir))
        assert code == 0, err
        restored = out_dir / "notes.txt"
        expected = "".join(notes[: k - 1])
        assert (restored.read_text() if restored.exists() else "") == expected
        assert (out_dir / "test_notes.py").read_text() == TEST_FILE

    code, _, err = _kvtrace(capfd, "workspace", f"base@{calls[1].depth}", "-o",
                            str(home / "restored-1"))
    assert code == 2 and "not empty: give --force" in err
    code, _, err = _kvtrace(capfd, "workspace", "base@4", "-o", str(home / "x"))
    assert code == 2 and "has no workspace snapshot (verdict)" in err
    assert "steps with one: @1, @2, @3" in err and not (home / "x").exists()

    code, out, _ = _kvtrace(capfd, "diff", f"base@{calls[0].depth}", "base", "--files")
    assert code == 0
    assert "added   notes.txt" in out and f"+{notes[0].strip()}" in out

    code, out, _ = _kvtrace(capfd, "show", f"base@{calls[0].depth}", "--json")
    assert json.loads(out)["meta"]["workspace"] == ModelCall(calls[0]).workspace
    code, out, err = _kvtrace(capfd, "fsck")
    assert code == 0, out + err


def test_a_failed_verdict_makes_record_exit_1_and_verify_grades_after_the_fact(
    home, capfd, tiny_model_folder
):
    work = home / "agent"
    code, _, err = _kvtrace(
        capfd, "record", "--model", str(tiny_model_folder), "--run", "base",
        "--workdir", str(work), "--verify", "test -f missing.txt", "--",
        sys.executable, str(AGENT), "--calls", "2")
    assert code == 1
    assert "verify failed (exit code 1)" in err

    code, out, _ = _kvtrace(capfd, "verify", "base", "--cmd", "grep -c . notes.txt",
                            "--workdir", str(work), "--json")
    assert code == 0 and json.loads(out)["passed"] and json.loads(out)["output"] == "2\n"
    code, out, _ = _kvtrace(capfd, "log", "base")
    assert out.count("verdict") == 2

    for bad in (["--verify", " "], ["--workspace", ".."]):
        code, _, err = _kvtrace(capfd, "record", "--model", str(tiny_model_folder),
                                "--workdir", str(work), *bad, "--",
                                sys.executable, str(AGENT))
        assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_k_agents_each_get_a_verdict_in_the_table_and_the_json(home, capfd, tiny_model_folder):
    code, _, err = _kvtrace(capfd, "record", "--model", str(tiny_model_folder), "--run", "base",
                            "--workdir", str(home / "base"), "--",
                            sys.executable, str(AGENT), "--calls", "3")
    assert code == 0, err
    runs = str(home / "runs" / "{i}")
    # Agent 1 passes (its folder has the file), agent 2 fails.
    (home / "runs" / "1").mkdir(parents=True)
    (home / "runs" / "1" / "ok").write_text("")
    code, out, err = _kvtrace(
        capfd, "record", "--model", str(tiny_model_folder), "--from", "base@3", "--n", "2",
        "--workdir", runs, "--workspace", ".", "--verify", "test -f ok", "--json", "--",
        sys.executable, str(AGENT), "--calls", "3")
    assert code == 1, err
    report = json.loads(out[out.index("{"):])
    assert [a["verdict"]["passed"] for a in report["agents"]] == [True, False]
    assert (report["passed"], report["failed"]) == (1, 1)

    code, _, err = _kvtrace(
        capfd, "record", "--model", str(tiny_model_folder), "--from", "base@3", "--n", "2",
        "--workdir", str(home / "again" / "{i}"), "--verify", "true", "--",
        sys.executable, str(AGENT), "--calls", "3")
    assert code == 0, err
    assert "2 of 2 passed" in err and " test " in err and "pass " in err


def test_verify_refuses_a_timeout_that_is_no_time_in_its_own_flag(home, capfd):
    code, _, err = _kvtrace(capfd, "verify", "r", "--cmd", "true")
    assert code == 2 and "store" in err  # no store yet: nothing made
    with open_store(f"sqlite:///{home / 'home' / 'store.db'}") as store:
        store.run("r").record_note("a run to grade")
    code, _, err = _kvtrace(capfd, "verify", "nothing", "--cmd", "true")
    assert code == 2 and "no run 'nothing'" in err
    code, _, err = _kvtrace(capfd, "verify", "r", "--cmd", "true", "--timeout", "0")
    assert code == 2 and err.strip() == "error: --timeout 0: give seconds > 0"
    code, out, _ = _kvtrace(capfd, "log", "r")
    assert "verdict" not in out


def test_a_fork_starts_from_the_recorded_workspace_and_is_snapshotted_too(
    home, capfd, tiny_model_folder
):
    base = home / "base"
    base.mkdir()
    (base / "seed.txt").write_text("the starting tree\n")
    code, _, err = _kvtrace(capfd, "record", "--model", str(tiny_model_folder), "--run", "base",
                            "--workdir", str(base), "--workspace", ".", "--",
                            sys.executable, str(AGENT), "--calls", "3")
    assert code == 0, err
    busy = home / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("the user's\n")
    code, _, err = _kvtrace(capfd, "record", "--model", str(tiny_model_folder),
                            "--from", "base@2", "--workdir", str(busy), "--",
                            sys.executable, str(AGENT), "--calls", "3")
    assert code == 2 and "is not empty" in err and (busy / "mine.txt").read_text() == "the user's\n"

    code, out, err = _kvtrace(
        capfd, "record", "--model", str(tiny_model_folder), "--from", "base@2", "--n", "2",
        "--workdir", str(home / "runs" / "{i}"), "--json", "--",
        sys.executable, str(AGENT), "--calls", "3")
    assert code == 0, err
    forks = [agent["run"] for agent in json.loads(out[out.index("{"):])["agents"]]
    with open_store(f"sqlite:///{home / 'home' / 'store.db'}", create=False) as store:
        recorded = [ModelCall(s).workspace for s in store.path("base")]
        for i, fork in enumerate(forks, start=1):
            assert (home / "runs" / str(i) / "seed.txt").read_text() == "the starting tree\n"
            live = [ModelCall(s).workspace for s in store.path(fork)]
            # Answered alike from the same start, the agent left the same files at call 3.
            assert live == recorded
            assert store.path(fork)[-1].id != store.path("base")[-1].id  # call 3 was live

    code, _, err = _kvtrace(capfd, "record", "--model", str(tiny_model_folder),
                            "--from", "base@2", "--run", "solo", "--workdir", str(home / "solo"),
                            "--", sys.executable, str(AGENT), "--calls", "3")
    assert code == 0, err
    assert (home / "solo" / "seed.txt").read_text() == "the starting tree\n"
    assert len((home / "solo" / "notes.txt").read_text().splitlines()) == 3


def test_runs_filter_by_verdict_and_log_says_it(home, capfd):
    with open_store(f"sqlite:///{home / 'home' / 'store.db'}") as store:
        for name in ("good", "bad", "ungraded"):
            store.run(name).record_note(f"{name} did its work")
    assert _kvtrace(capfd, "verify", "good", "--cmd", "true")[0] == 0
    assert _kvtrace(capfd, "verify", "bad", "--cmd", "exit 3")[0] == 1
    code, out, _ = _kvtrace(capfd, "runs", "--verdict", "passed")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == ["good"]
    code, out, _ = _kvtrace(capfd, "runs", "--verdict", "failed", "--json")
    assert [(r["name"], r["verdict"]) for r in json.loads(out)] == [("bad", "failed")]
    code, out, _ = _kvtrace(capfd, "runs", "--verdict", "none")
    assert [line.split()[0] for line in out.splitlines()] == ["ungraded"]
    code, out, _ = _kvtrace(capfd, "log", "bad")
    assert "verdict" in out and "FAILED (exit code 3)" in out
    code, _, err = _kvtrace(capfd, "runs", "--verdict", "maybe")
    assert code == 2 and len(err.strip().splitlines()) == 1
