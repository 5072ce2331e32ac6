"""`kvtrace diff`: the common-ancestor summary, then the first differing step's fields as diffs."""

from __future__ import annotations

import json

import pytest

from kvtrace import open_store
from kvtrace.cli import main
from tests.agent_runs import call, record_answer, record_calc_run


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    with open_store() as store:
        record_calc_run(store.run("main"))
        record_answer(store.fork("main@1", "fixed"), "What is 17 * 23?", call("17 * 23"),
                      "392 (checked by hand)")
        record_calc_run(store.run("other"), question="What is 17 * 24?", expr="17 * 24")
    return tmp_path


def kv(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_diff_of_a_fork_names_the_edited_step_and_shows_the_edited_text(home, capsys):
    code, out, _ = kv(capsys, "diff", "main", "fixed")
    assert code == 0
    with open_store() as store:
        edited = store.show("fixed@2").short_id
    assert out.startswith("common: 1 ")
    assert "first difference at @2:" in out
    assert f"fixed@2: {edited} tool_call" in out
    assert "--- main result" in out and "+++ fixed result" in out
    assert "\n-391\n" in out and "\n+392 (checked by hand)\n" in out


def test_diff_of_unrelated_runs_aligns_them_from_the_root(home, capsys):
    code, out, _ = kv(capsys, "diff", "main", "other")
    assert code == 0 and "common: (none)" in out and "first difference at @1:" in out
    assert "-What is 17 * 23?" in out and "+What is 17 * 24?" in out
    assert '+  "expr": "17 * 24"' in out  # the response's tool-call arguments


def test_diff_json_keeps_the_summary_and_adds_the_first_difference(home, capsys):
    code, out, _ = kv(capsys, "diff", "main", "fixed", "--json")
    document = json.loads(out)
    assert code == 0
    assert {"common", "first_a", "first_b", "num_only_a", "num_only_b"} <= set(document)
    assert document["related"] is True and document["num_only_b"] == 2
    first = document["first_difference"]
    assert first["position"] == 2 and first["b"]["kind"] == "tool_call"
    assert first["changes"] == [{
        "field": "result", "a": "391", "b": "392 (checked by hand)",
        "diff": ["--- main result", "+++ fixed result", "@@ -1 +1 @@", "-391",
                 "+392 (checked by hand)"],
    }]


@pytest.mark.parametrize("argv", [["diff", "main", "nosuchrun"], ["diff", "main"]])
def test_diff_bad_input_is_one_error_line_and_exit_2(home, capsys, argv):
    code, out, err = kv(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
