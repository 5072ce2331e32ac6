"""Docs are checked: every CLI command has help text and is documented in docs/cli.md."""

from __future__ import annotations

from pathlib import Path

import typer.main

from kvtrace.cli import app

ROOT = Path(__file__).resolve().parent.parent


def cli_commands():
    """(name, click command) of every leaf command, `cache gc` style for groups."""
    root = typer.main.get_command(app)
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        sub = getattr(command, "commands", None)
        if sub:
            for sub_name, sub_command in sub.items():
                yield f"{name} {sub_name}", sub_command
        else:
            yield name, command


def test_every_command_has_help():
    for name, command in cli_commands():
        assert (command.help or "").strip(), f"`kvtrace {name}` has no help text"
        for param in command.params:
            if (
                param.name
                and getattr(param, "help", None) is None
                and param.param_type_name == "option"
            ):
                raise AssertionError(f"option {param.name} of `kvtrace {name}` has no help")


def test_every_command_is_in_the_cli_docs():
    text = (ROOT / "docs" / "cli.md").read_text()
    missing = [name for name, _ in cli_commands() if f"kvtrace {name}" not in text]
    assert not missing, f"docs/cli.md does not document: {missing}"


def test_readme_shows_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
