"""Refused calls: a tool error (isError) whose text is the one line the CLI prints for the same
mistake (its flags named), and nothing changed in the store. On SQLite and PostgreSQL."""

from __future__ import annotations

import json

import pytest

from kvtrace import open_store
from kvtrace.errors import RunNotFoundError
from tests.agent_runs import record_calc_run
from tests.mcp.conftest import cli_error, state


@pytest.fixture
def job(stores, name):
    with open_store(stores) as store:
        record_calc_run(store.run(name), question=f"What is 17 * 23? ({name})")
    return name


def _refused(client, url, tool, **arguments) -> str:
    """The tool's error line, checked to have changed nothing."""
    before = state(url)
    message = client.fail(tool, **arguments)
    assert state(url) == before
    assert "\n" not in message
    return message


def test_an_unknown_run_is_the_clis_error_for_the_same_call(client, stores, capsys):
    assert _refused(client, stores, "log", run="nobody") == cli_error(
        capsys, stores, "log", "nobody")
    assert _refused(client, stores, "revert", run="nobody", to="nobody@1") == cli_error(
        capsys, stores, "revert", "nobody", "--to", "nobody@1")
    assert _refused(client, stores, "fork", spec="nobody@1", new="x") == cli_error(
        capsys, stores, "fork", "nobody@1", "x")
    assert "no run named 'nobody'" in _refused(client, stores, "log", run="nobody")


def test_an_unknown_run_for_a_tool_without_a_cli_twin_is_the_librarys_message(client, stores):
    expected = str(RunNotFoundError("no run named 'nobody' (see `kvtrace runs`)"))
    for tool in ("watch", "pause", "resume"):
        assert _refused(client, stores, tool, run="nobody") == expected


@pytest.mark.parametrize("spec", ["{job}@0", "{job}@x", "{job}@99", "abc def"])
def test_a_bad_step_address_is_the_clis_error(client, stores, job, capsys, spec):
    spec = spec.format(job=job)
    assert _refused(client, stores, "show_step", spec=spec) == cli_error(
        capsys, stores, "show", spec)
    assert _refused(client, stores, "note", spec=spec, text="t") == cli_error(
        capsys, stores, "note", spec, "t")


@pytest.mark.parametrize(("at", "edit"), [
    ("@2", {"nonsense": 1}),
    ("@2", {"result": 1, "tool": "x"}),
    ("@1", {"response": {"role": "user", "content": "x"}}),
])
def test_a_bad_edit_is_refused_as_the_cli_refuses_it_and_makes_no_run(
        client, stores, job, capsys, tmp_path, at, edit):
    edit_file = tmp_path / "edit.json"
    edit_file.write_text(json.dumps(edit))
    expected = cli_error(capsys, stores, "branch", f"{job}{at}", "--n", "1",
                         "--edit", str(edit_file))
    assert _refused(client, stores, "fork", spec=f"{job}{at}", new=f"{job}-x",
                    edit=edit) == expected
    assert _refused(client, stores, "branch", spec=f"{job}{at}", n=1, edit=edit) == expected


def test_an_empty_edit_is_refused(client, stores, job):
    assert _refused(client, stores, "fork", spec=f"{job}@2", new=f"{job}-x", edit={}) == (
        "edit must map content fields to their new values")


def test_a_parameter_the_library_names_is_written_as_the_clis_flag(client, stores, job,
                                                                   capsys):
    with open_store(stores) as store:
        store.run(f"{job}-other").record_note("elsewhere")
    wrong = _refused(client, stores, "replay", run=job, to=f"{job}-other@1")
    assert wrong == cli_error(capsys, stores, "replay", job, "--to", f"{job}-other@1")
    assert wrong.startswith(f"--to '{job}-other@1' is not a step of '{job}'")
    assert _refused(client, stores, "branch", spec=job, n=0) == cli_error(
        capsys, stores, "branch", job, "--n", "0")
    assert _refused(client, stores, "branch", spec=job, n=0).startswith("--n 0: ")


def test_a_move_that_is_not_backwards_is_refused(client, stores, job, capsys):
    assert _refused(client, stores, "revert", run=job, to=f"{job}@3") == cli_error(
        capsys, stores, "revert", job, "--to", f"{job}@3")
    with open_store(stores) as store:
        store.fork(f"{job}@1", f"{job}-new")  # a fork has no move of its own to undo
    assert _refused(client, stores, "undo", run=f"{job}-new") == cli_error(
        capsys, stores, "undo", f"{job}-new")


def test_pausing_twice_and_resuming_a_running_run_are_refused(client, stores, job):
    assert _refused(client, stores, "resume", run=job) == f"run {job!r} is not paused"
    client.call("pause", run=job)
    assert _refused(client, stores, "pause", run=job) == f"run {job!r} is already paused"
    client.call("resume", run=job)


@pytest.mark.parametrize(("tool", "arguments", "start"), [
    ("log", {"limit": 0}, "--limit 0: "),
    ("show_step", {"max_bytes": 10}, "max_bytes=10: "),
    ("show_step", {"offset": 5}, "offset=5: an offset pages a value: name it with pointer"),
    ("show_step", {"offset": -1, "pointer": "/result"}, "offset=-1: an offset is 0 or more"),
    ("watch", {"timeout": -1}, "timeout=-1.0: "),
    ("watch", {"max_events": 0}, "max_events=0: "),
    ("watch", {"cursor": -2}, "cursor=-2: "),
])
def test_bad_limits_are_one_line_naming_the_argument(client, stores, job, tool, arguments,
                                                     start):
    key = "spec" if tool == "show_step" else "run"
    assert _refused(client, stores, tool, **{key: job}, **arguments).startswith(start)


def test_an_error_quoting_what_the_caller_sent_is_one_inert_line(client, stores, job):
    message = _refused(client, stores, "show_step", spec=f"{job}@2",
                       pointer="/res\x1b[2J\nult\u202e")
    assert message.startswith("pointer='/res\\x1b[2J\\nult\\u202e' names nothing in step ")
    assert "keys arguments, result" in message
