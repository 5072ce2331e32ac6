"""The replay commands: thin calls of the API, JSON for programs, one-line errors."""

from __future__ import annotations

import json

import pytest

import kvtrace.cli.replay  # noqa: F401  (registers the commands until kvtrace.cli imports it)
from kvtrace.cli import main


def _record(store_url):
    from kvtrace import open_store

    with open_store(store_url) as store:
        run = store.run("agent")
        messages = [{"role": "user", "content": "Question: 6*7?"}]
        run.record_model_call(list(messages), "Action: calculator\nAction Input: 6*7", model="m")
        run.record_tool_call("calculator", "6*7", 42)
        messages += [
            {"role": "assistant", "content": "Action: calculator\nAction Input: 6*7"},
            {"role": "user", "content": "Observation: 42"},
        ]
        run.record_model_call(list(messages), "Final Answer: 42", model="m")
        store.fork("agent@2", "mid")  # ends with a tool result: ready to continue


def _run(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def _answer(messages):
    return "Final Answer: 42" if len(messages) > 1 else "Action: calculator\nAction Input: 6*7"


def test_replay_json_against_a_remote_backend(tmp_path, capsys, stand_in_server):
    url = f"sqlite:///{tmp_path / 's.db'}"
    _record(url)
    server = stand_in_server(_answer)
    code, out, _ = _run(
        capsys,
        "--store",
        url,
        "replay",
        "agent",
        "--backend",
        server.url,
        "--mode",
        "verify",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert len(data["steps"]) == 2 and data["total"]["tool_steps"] == 1
    assert data["steps"][1]["reused_tokens"] == server.cached_answers[1] > 0
    assert data["total"]["matching_steps"] == 2


@pytest.mark.parametrize("flag", ["--no-cache", "--no-draft"])
def test_a_flag_that_does_not_apply_is_a_one_line_error(tmp_path, capsys, stand_in_server, flag):
    """--no-cache needs the local backend, --no-draft verify mode: refused before any call."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    _record(url)
    server = stand_in_server(_answer)
    code, _, err = _run(capsys, "--store", url, "replay", "agent", "--backend", server.url, flag)
    assert code == 2 and flag in err and len(err.strip().splitlines()) == 1
    assert server.requests == []


def test_continue_without_tools_names_the_missing_tool(tmp_path, capsys, stand_in_server):
    url = f"sqlite:///{tmp_path / 's.db'}"
    _record(url)
    server = stand_in_server(lambda m: "Action: lookup\nAction Input: Rome")
    code, _, err = _run(
        capsys,
        "--store",
        url,
        "continue",
        "mid",
        "--steps",
        "2",
        "--backend",
        server.url,
        "--tools",
        "none",
        "--model",
        "stand-in",
    )
    assert code == 2 and "'lookup'" in err


def test_continue_with_demo_tools_records_tool_calls(tmp_path, capsys, stand_in_server):
    url = f"sqlite:///{tmp_path / 's.db'}"
    _record(url)
    server = stand_in_server(
        lambda m: (
            "Final Answer: done"
            if "Norway" in m[-1]["content"]
            else "Action: lookup\nAction Input: Oslo"
        )
    )
    code, out, _ = _run(
        capsys,
        "--store",
        url,
        "continue",
        "mid",
        "--steps",
        "3",
        "--backend",
        server.url,
        "--tools",
        "demo",
        "--model",
        "m",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert [s["kind"] for s in data["new_steps"]] == ["model_call", "tool_call", "model_call"]
    assert data["final_answer"] == "done"


@pytest.mark.slow
def test_analyze_json_with_the_default_tokenizer(tmp_path, capsys, default_model_folder):
    url = f"sqlite:///{tmp_path / 's.db'}"
    _record(url)
    code, out, _ = _run(capsys, "--store", url, "analyze", "agent", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["total"]["steps"] == 2 and data["breakers"] == []
    assert data["steps"][1]["oracle_tokens"] > data["steps"][0]["prompt_tokens"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["continue", "nosuch", "--steps", "1", "--tools", "demo"], "no run named 'nosuch'"),
        (["continue", "agent", "--steps", "0"], "--steps"),
        (["replay", "nosuch"], "no run named 'nosuch'"),
        (["replay", "agent", "--mode", "bogus"], "'bogus' is not one of 'verify', 'rebuild'"),
        (["replay", "mid", "--to", "agent"], "--to 'agent' is not a step of 'mid'"),
        (["checkout", "nosuch"], "no run named 'nosuch'"),
    ],
)
def test_bad_input_fails_before_a_model_loads_and_changes_nothing(tmp_path, capsys, args, says):
    """A model that cannot load would fail first; the error names the input instead."""
    from kvtrace import open_store

    url = f"sqlite:///{tmp_path / 's.db'}"
    _record(url)
    def state():
        with open_store(url) as store:
            return [(r.name, r.head_id, len(store.reflog(r.name))) for r in store.runs()]

    before = state()
    code, out, err = _run(capsys, "--store", url, *args, "--model", str(tmp_path / "no-model"))
    assert code == 2 and out == ""
    assert err.startswith("error:") and err.count("\n") == 1 and says in err
    assert state() == before


def test_a_failure_during_a_replay_prints_exactly_one_line(tmp_path, capsys, stand_in_server):
    """No progress bar off a terminal, so nothing but the error reaches stderr."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    _record(url)
    server = stand_in_server(_answer, fail_status=500)
    code, out, err = _run(capsys, "--store", url, "replay", "agent", "--backend", server.url,
                          "--retries", "0")
    assert code == 2 and out == ""
    assert err.startswith("error:") and err.count("\n") == 1


def test_branch_decodes_its_branches_on_the_engine_thread_that_loaded_the_model(
        tmp_path, capsys, monkeypatch, tiny_model_factory):
    """`kvtrace branch` loads the local engine on its DecodeBatcher's thread (a thread that
    did not load the model pays for every MKL call) and still forks, decodes and records."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    _record(url)
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_factory("cli-branch", seed=3)
    code, out, err = _run(capsys, "--store", url, "branch", "mid", "--n", "2", "--steps", "1",
                          "--tools", "none", "--model", str(folder), "--max-new-tokens", "4",
                          "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [(b["steps"], b["model_calls"]) for b in data["branches"]] == [(1, 1), (1, 1)]
    assert all(b["output_tokens"] > 0 for b in data["branches"])
    from kvtrace import open_store

    with open_store(url) as store:
        names = [b["run"] for b in data["branches"]]
        assert [store.path(name)[2].kind for name in names] == ["model_call", "model_call"]
