"""One CLI: every command takes the one `--json`; mutating commands say what they did;
`-o` never replaces a file without `--force`; enum options refuse other values; library
errors name parameters, the CLI names its flags. All on a real SQLite store."""

from __future__ import annotations

import enum
import inspect
import json
import typing
from pathlib import Path

import pytest

from kvtrace import UsageError, open_store
from kvtrace.cli.app import Json, app
from kvtrace.replay.driver import steps_to_replay
from tests.test_cli_store import kv
from tests.test_docs import cli_commands as _commands


def _options(command):
    return [p for p in command.params if p.param_type_name == "option"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    monkeypatch.delenv("KVTRACE_DEBUG", raising=False)
    with open_store() as store:
        run = store.run("main")
        for i in range(4):
            run.record_tool_call("calc", {"x": i}, i + 1)
    return tmp_path


def _state() -> list:
    """Every run's head and every reflog entry: what a refused command must leave as it was."""
    with open_store() as store:
        return [[info.to_dict() for info in store.runs()],
                [entry.to_dict() for entry in store.reflog()]]


# -- --json everywhere ------------------------------------------------------------


def test_every_command_takes_the_one_shared_json_option():
    shared_help = typing.get_args(Json)[1].help
    for name, command in _commands():
        flags = [p for p in _options(command) if "--json" in p.opts]
        assert flags, f"`kvtrace {name}` has no --json"
        assert flags[0].help == shared_help, f"`kvtrace {name}` declares its own --json"


def test_fork_json_names_the_new_run_its_head_and_where_it_came_from(home, capsys):
    code, out, _ = kv(capsys, "fork", "main@2", "exp", "--json")
    forked = json.loads(out)
    with open_store() as store:
        head = store.show("main@2").id
    assert code == 0 and forked == {"run": "exp", "head": head, "depth": 2,
                                    "forked_from": "main@2"}


@pytest.mark.parametrize(("argv", "reason"), [
    (["revert", "main", "--to", "main~2"], "revert"),
    (["reset", "main", "--to", "main@1"], "reset"),
])
def test_a_move_with_json_prints_its_reflog_entry(home, capsys, argv, reason):
    code, out, _ = kv(capsys, *argv, "--json")
    entry = json.loads(out)
    with open_store() as store:
        newest = store.reflog("main")[0]
        assert code == 0 and entry == newest.to_dict()
        assert entry["reason"] == reason and entry["new_head"] == store.head("main").id


def test_undo_with_json_prints_the_reflog_entry_of_the_undo(home, capsys):
    kv(capsys, "revert", "main", "--to", "main~1")
    code, out, _ = kv(capsys, "undo", "main", "--json")
    entry = json.loads(out)
    with open_store() as store:
        assert code == 0 and entry["message"] == "undo revert"
        assert entry["new_head"] == store.head("main").id and store.head("main").depth == 4


def test_note_with_json_prints_the_note(home, capsys):
    code, out, _ = kv(capsys, "note", "main@1", "look here", "--author", "me", "--json")
    added = json.loads(out)
    with open_store() as store:
        assert code == 0 and added == store.notes("main@1")[0].to_dict()
    assert added["text"] == "look here" and added["author"] == "me"


def test_export_and_import_with_json_print_the_file_and_the_new_run(home, capsys):
    bundle = home / "main.kvtrace"
    code, out, _ = kv(capsys, "export", "main", "-o", str(bundle), "--json")
    written = json.loads(out)
    assert code == 0 and written == {"run": "main", "format": "bundle", "path": str(bundle),
                                     "num_steps": 4, "num_bytes": bundle.stat().st_size}
    code, out, _ = kv(capsys, "import", str(bundle), "--as", "copy", "--json")
    imported = json.loads(out)
    assert code == 0 and imported["name"] == "copy" and imported["depth"] == 4


def test_export_json_needs_a_file_to_report_on(home, capsys):
    code, out, err = kv(capsys, "export", "main", "--json")
    assert code == 2 and out == "" and err.startswith("error: ") and "-o FILE" in err


def test_init_and_report_with_json_say_what_they_wrote(home, capsys):
    code, out, _ = kv(capsys, "init", "--json")
    assert code == 0 and json.loads(out)["store"].endswith("store.db")
    page = home / "r.html"
    code, out, _ = kv(capsys, "report", "main", "-o", str(page), "--no-tokens", "--json")
    assert code == 0 and json.loads(out) == {"path": str(page), "runs": ["main"],
                                             "num_steps": 4, "num_forks": 0, "tokenizer": None}
    assert page.read_text().startswith("<!DOCTYPE html>")


def test_bench_prints_figures_as_text_or_with_json_as_one_object(home, capsys):
    code, out, _ = kv(capsys, "bench", "appends", "--appends", "3", "--json")
    figures = json.loads(out)
    assert code == 0 and figures["num_appends"] == 3 and len(figures["stores"]) == 2
    code, out, _ = kv(capsys, "bench", "appends", "--appends", "3")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["num_appends", "3"]
    assert lines[1].startswith("stores[0].url ") and "synchronous=full" in out
    with pytest.raises(ValueError):
        json.loads(out)


def _callbacks():
    """Every command's Python function, in the root app and its groups."""
    typers = [app] + [group.typer_instance for group in app.registered_groups]
    return [command.callback for t in typers for command in t.registered_commands]


def test_parameters_are_annotated_and_a_none_default_is_typed_optional():
    for callback in _callbacks():
        hints = typing.get_type_hints(callback, include_extras=True)
        for name, parameter in inspect.signature(callback).parameters.items():
            if name == "ctx":
                continue
            hint = hints[name]
            assert typing.get_origin(hint) is typing.Annotated, f"{callback.__name__}({name})"
            if parameter.default is None:
                assert type(None) in typing.get_args(typing.get_args(hint)[0]), (
                    f"{callback.__name__}({name}) defaults to None: type it X | None")


# -- -o never replaces a file without --force ---------------------------------------

_WRITE_ARGS = {  # every command with -o: its arguments besides -o
    "export": ["export", "main"],
    "report": ["report", "main", "--no-tokens"],
}


# -o names a folder here: a non-empty one is refused without --force (tests/workspace).
_FOLDER_OUTPUT = {"workspace"}


def test_every_command_with_an_output_file_is_checked_for_overwrites():
    with_output = {name for name, command in _commands()
                   if any("-o" in p.opts for p in _options(command))}
    assert with_output == set(_WRITE_ARGS) | _FOLDER_OUTPUT
    for name, command in _commands():
        if name in with_output:
            assert any("--force" in p.opts for p in _options(command)), name


@pytest.mark.parametrize("name", sorted(_WRITE_ARGS))
def test_o_refuses_an_existing_file_without_force_and_replaces_it_with(home, capsys, name):
    target = home / "existing.out"
    target.write_text("the user's own file")
    code, out, err = kv(capsys, *_WRITE_ARGS[name], "-o", str(target))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {target} exists: pass --force")
    assert target.read_text() == "the user's own file"
    assert [p.name for p in home.iterdir() if p.name.endswith(".tmp")] == []
    code, _, _ = kv(capsys, *_WRITE_ARGS[name], "-o", str(target), "--force")
    assert code == 0 and target.read_text() != "the user's own file"


# -- enum options ---------------------------------------------------------------------

_BAD_VALUES = {  # (command, option): a command line with a bad value for it
    ("replay", "--mode"): ["replay", "main", "--mode", "fast"],
    ("replay", "--backend"): ["replay", "main", "--backend", "remote"],
    ("continue", "--tools"): ["continue", "main", "--steps", "1", "--tools", "all"],
    ("continue", "--backend"): ["continue", "main", "--steps", "1", "--backend", "ftp://x"],
    ("analyze", "--backend"): ["analyze", "main", "--backend", "ftp://x"],
    ("branch", "--tools"): ["branch", "main", "--n", "2", "--tools", "all"],
    ("export", "--format"): ["export", "main", "--format", "csv"],
    ("import", "--format"): ["import", "main.kvtrace", "--format", "csv"],
    ("mcp", "--transport"): ["mcp", "--transport", "carrier-pigeon"],
    ("runs", "--verdict"): ["runs", "--verdict", "maybe"],
    ("replay", "--dtype"): ["replay", "main", "--dtype", "int4"],
    ("cache size", "--dtype"): ["cache", "size", "--tokens", "10", "--dtype", "int8"],
    ("checkout", "--dtype"): ["checkout", "main", "--dtype", "float64"],
    ("continue", "--dtype"): ["continue", "main", "--steps", "1", "--dtype", "half"],
    ("branch", "--dtype"): ["branch", "main", "--n", "2", "--dtype", "fp8"],
    ("serve", "--dtype"): ["serve", "--dtype", "int8"],
    ("record", "--dtype"): ["record", "--dtype", "int8", "--", "true"],
    ("bench fork", "--dtype"): ["bench", "fork", "--peer", "http://127.0.0.1:9/v1",
                               "--dtype", "float16"],
    ("bench replay", "--dtype"): ["bench", "replay", "--dtype", "int8"],
    ("bench decode", "--dtype"): ["bench", "decode", "--dtype", "int8"],
}


def _is_enum(option) -> bool:
    annotation = option.type_descriptor.annotation
    return isinstance(annotation, type) and issubclass(annotation, enum.Enum)


def test_every_enum_option_and_backend_is_covered():
    checked = {(name, p.opts[0]) for name, command in _commands() for p in _options(command)
               if _is_enum(p) or p.opts[0] == "--backend"}
    assert checked == set(_BAD_VALUES)


@pytest.mark.parametrize("key", sorted(_BAD_VALUES))
def test_a_bad_enum_value_is_one_error_line_exit_2_and_changes_nothing(home, capsys, key):
    before = _state()
    code, out, err = kv(capsys, *_BAD_VALUES[key])
    assert code == 2 and out == ""
    assert err.startswith(f"error: Invalid value for '{key[1]}'") and err.count("\n") == 1
    assert _state() == before


# -- library errors name parameters; the CLI names its flags ----------------------------


def test_a_library_error_names_the_parameter_and_carries_it(home):
    with open_store() as store:
        store.fork("main@2", "short")
        with pytest.raises(UsageError, match=r"^to='main@4' is not a step of 'short'") as info:
            steps_to_replay(store, "short", to="main@4")
    assert info.value.param == "to"


def test_the_cli_writes_the_parameter_as_the_commands_flag(home, capsys):
    bundle = home / "main.kvtrace"
    kv(capsys, "export", "main", "-o", str(bundle))
    kv(capsys, "revert", "main", "--to", "main~1")  # the bundle's run now has another head
    before = _state()
    code, _, err = kv(capsys, "import", str(bundle))  # Store.import_bundle(name=) is --run
    assert code == 2 and err.count("\n") == 1
    assert "import it under a new name (--run NAME)" in err and "name=" not in err
    assert _state() == before


def test_the_readme_and_cli_docs_state_the_conventions():
    root = Path(__file__).resolve().parent.parent
    cli = (root / "docs" / "cli.md").read_text()
    readme = (root / "README.md").read_text()
    for text in (cli, readme):
        assert "--force" in text and "--json" in text
