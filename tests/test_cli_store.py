"""The CLI over the store: a tour as a user types it, and one-line errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtrace import open_store
from kvtrace.cli import main


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    store = open_store()
    run = store.run("main")
    for i in range(4):
        run.record_tool_call("calc", {"x": i}, i + 1)
    store.close()
    return tmp_path


def kv(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_runs_and_log_json(home, capsys):
    code, out, _ = kv(capsys, "runs", "--json")
    assert code == 0 and json.loads(out)[0]["depth"] == 4
    code, out, _ = kv(capsys, "log", "main", "--json")
    assert [s["depth"] for s in json.loads(out)] == [4, 3, 2, 1]


def test_fork_revert_reset_tour(home, capsys):
    head = json.loads(kv(capsys, "show", "main", "--json")[1])["id"]
    assert kv(capsys, "fork", "main@2", "exp")[0] == 0
    assert kv(capsys, "revert", "main", "--to", "main~2")[0] == 0
    assert json.loads(kv(capsys, "show", "main", "--json")[1])["depth"] == 2
    assert kv(capsys, "reset", "main", "--to", head[:10])[0] == 0
    assert json.loads(kv(capsys, "show", "main", "--json")[1])["id"] == head
    reasons = [e["reason"] for e in json.loads(kv(capsys, "reflog", "main", "--json")[1])]
    assert reasons[:2] == ["reset", "revert"]
    code, out, _ = kv(capsys, "log", "main", "--graph")
    assert code == 0 and "(main)" in out and "other branch" not in out


def test_note_shows_up_in_show(home, capsys):
    assert kv(capsys, "note", "main@1", "check this", "--author", "me")[0] == 0
    shown = json.loads(kv(capsys, "show", "main@1", "--json")[1])
    assert shown["notes"][0]["text"] == "check this"


def test_export_import_and_fsck(home, capsys, tmp_path):
    bundle = tmp_path / "main.kvtrace"
    assert kv(capsys, "export", "main", "-o", str(bundle))[0] == 0
    assert kv(capsys, "import", str(bundle), "--as", "copy")[0] == 0
    code, out, _ = kv(capsys, "fsck", "--json")
    assert code == 0 and json.loads(out)["ok"] is True


@pytest.mark.parametrize(
    "argv",
    [
        ["log", "nosuchrun"],
        ["show", "main@99"],
        ["fork", "main", "bad name"],
        ["revert", "main", "--to", "nosuchrun"],
        ["import", "/nonexistent/bundle"],
        ["log"],
        ["frobnicate"],
    ],
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(home, capsys, argv):
    before = kv(capsys, "reflog", "main", "--json")[1]
    code, _, err = kv(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert kv(capsys, "reflog", "main", "--json")[1] == before


def test_console_script_runs_in_a_real_process(home):
    result = subprocess.run(
        [sys.executable, "-m", "kvtrace", "log", "main@1", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0]["depth"] == 1


def test_diff_names_the_common_step(home, capsys):
    kv(capsys, "fork", "main@2", "exp")
    code, out, _ = kv(capsys, "diff", "main", "exp", "--json")
    result = json.loads(out)
    assert code == 0 and result["common"]["depth"] == 2 and result["num_only_a"] == 2


def test_reading_in_a_folder_without_a_store_creates_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "nothing-here"))
    code, _, err = kv(capsys, "log", "main")
    assert code == 2 and "kvtrace init" in err
    assert not (tmp_path / "nothing-here").exists()


def test_export_to_a_missing_folder_is_exit_2_and_leaves_no_file(home, capsys, tmp_path):
    code, _, err = kv(capsys, "export", "main", "-o", str(tmp_path / "no" / "x.kvtrace"))
    assert code == 2 and err.startswith("error: ")
    code, _, _ = kv(capsys, "export", "nosuchrun", "-o", str(tmp_path / "y.kvtrace"))
    assert code == 2 and list(tmp_path.glob("y.kvtrace*")) == []


def test_log_graph_marks_forks(home, capsys):
    kv(capsys, "fork", "main@2", "exp")
    code, out, _ = kv(capsys, "log", "main", "--graph")
    assert code == 0 and "(exp)" in out and "(main)" in out
    open_store().run("exp").record_tool_call("calc", {"x": 99}, 100)
    _, out, _ = kv(capsys, "log", "main", "--graph", "--json")
    rows = json.loads(out)
    assert [row["num_branches"] for row in rows] == [0, 0, 1, 0]
    assert [row["branch_runs"] for row in rows] == [[], [], ["exp"], []]
    _, out, _ = kv(capsys, "log", "main", "--graph")
    assert "exp leaves this step" in out
    # Reverted, exp no longer takes the branch: it is still counted, unnamed.
    assert kv(capsys, "revert", "exp", "--to", "exp~1")[0] == 0
    _, out, _ = kv(capsys, "log", "main", "--graph", "--json")
    rows = json.loads(out)
    assert [(row["num_branches"], row["branch_runs"]) for row in rows][2] == (1, [])


def test_log_of_an_empty_run_says_so(home, capsys):
    open_store().run("blank")
    for graph in ([], ["--graph"]):
        code, out, _ = kv(capsys, "log", "blank", *graph)
        assert code == 0 and out.strip() == "blank has no steps yet"


def test_log_limit_below_one_is_a_one_line_error(home, capsys):
    code, out, err = kv(capsys, "log", "main", "-n", "0")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--limit" in err


def test_runs_pages_with_limit_and_after(home, capsys):
    for name in ("b", "c"):
        kv(capsys, "fork", "main@1", name)
    code, out, _ = kv(capsys, "runs", "-n", "2", "--json")
    assert code == 0 and [run["name"] for run in json.loads(out)] == ["b", "c"]
    code, out, _ = kv(capsys, "runs", "--limit", "2", "--after", "c")
    assert code == 0 and out.split()[0] == "main" and len(out.splitlines()) == 1
    code, _, err = kv(capsys, "runs", "-n", "0")
    assert code == 2 and err.startswith("error: ")


# -- error lines that say what to do (issue 41, item 12) --------------------------------------


def test_a_path_given_as_the_store_is_told_the_url_it_means(home, capsys):
    code, _, err = kv(capsys, "--store", "store.db", "runs")
    assert code == 2 and err.count("\n") == 1
    assert "'sqlite:///store.db'" in err
    assert not (home / "store.db").exists()


@pytest.mark.parametrize("target", ["/dev/null", "empty.jsonl", "folder"])
def test_importing_nothing_says_why(home, capsys, target):
    (home / "empty.jsonl").write_bytes(b"")
    (home / "folder").mkdir()
    path = target if target.startswith("/") else str(home / target)
    code, _, err = kv(capsys, "import", path)
    assert code == 2 and err.count("\n") == 1
    assert ("is a folder" if target == "folder" else "is empty") in err
    assert [r.name for r in open_store().runs()] == ["main"]  # nothing imported


def test_record_checks_the_program_before_loading_the_model(home, capsys, monkeypatch):
    cache = home / "cache"
    monkeypatch.setenv("KVTRACE_CACHE", str(cache))
    code, _, err = kv(capsys, "record", "--", "no-such-agent-program-41")
    assert code == 2 and "no such program" in err and err.count("\n") == 1
    assert not cache.exists() or not any(cache.iterdir())  # no model was converted or loaded
    assert [r.name for r in open_store().runs()] == ["main"]


DATA = __import__("pathlib").Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize(("argv", "says"), [
    (["import", str(next((DATA / "codex").glob("rollout-*.jsonl")))],
     "looks like a Codex rollout, not a kvtrace bundle: import it with --format codex"),
    (["import", "--format", "claude-code", str(next((DATA / "codex").glob("rollout-*.jsonl")))],
     "not a Claude Code session log: import it with --format codex"),
    (["import", str(DATA / "atif_v1_4_tools.json")], "import it with --format atif"),
    (["import", "--format", "codex", str(next((DATA / "claude_code").glob("*.jsonl")))],
     "import it with --format claude-code"),
    (["import", str(DATA / "openai_tau_airline.json")], "import it with --format openai"),
    (["runs", "--store", "sqlite:///elsewhere.db"],
     "--store is an option of kvtrace itself: it goes before the command"),
])
def test_a_misplaced_format_or_option_is_named_with_the_fix(home, capsys, argv, says):
    code, _, err = kv(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and says in err
    assert [r.name for r in open_store().runs()] == ["main"]


def test_an_import_whose_run_exists_names_the_option_for_another(home, capsys):
    rollout = str(next((DATA / "codex").glob("rollout-*.jsonl")))
    assert kv(capsys, "import", "--format", "codex", "--run", "cx", rollout)[0] == 0
    code, _, err = kv(capsys, "import", "--format", "codex", "--run", "cx", rollout)
    assert code == 2 and "run 'cx' exists with 23 steps" in err and "(--run NAME)" in err


def test_show_cuts_a_huge_value_by_the_one_rule_and_full_shows_it_whole(home, capsys):
    from kvtrace.store.present.shown import MAX_SHOWN

    huge = "x" * (MAX_SHOWN + 12_345)
    store = open_store()
    store.run("big").record_tool_call("read_file", {"path": "/dump"}, huge)
    store.close()
    code, out, _ = kv(capsys, "show", "big")
    assert code == 0 and huge not in out
    assert "x" * MAX_SHOWN + "… (12,345 more characters)" in out
    assert out.rstrip().endswith(f"1 value(s) cut at {MAX_SHOWN:,} characters: kvtrace show "
                                 "--full big shows them whole")
    code, out, _ = kv(capsys, "show", "big", "--full")
    assert code == 0 and huge in out and "more characters" not in out
    assert json.loads(kv(capsys, "show", "big", "--json")[1])["content"]["result"] == huge


def test_fork_with_an_edit_ends_the_new_run_on_an_edited_copy(home, capsys, tmp_path):
    edit = tmp_path / "edit.json"
    edit.write_text(json.dumps({"result": 99}))
    code, out, _ = kv(capsys, "fork", "main@2", "what-if", "--edit", str(edit))
    assert code == 0, out
    edited = json.loads(kv(capsys, "show", "what-if", "--json")[1])
    original = json.loads(kv(capsys, "show", "main@2", "--json")[1])
    assert edited["content"]["result"] == 99 and original["content"]["result"] == 2
    assert edited["parent_id"] == original["parent_id"]
    code, _, err = kv(capsys, "fork", "main@2", "other", "--edit", str(tmp_path / "none.json"))
    assert code == 2 and err.count("\n") == 1 and "--edit" in err
