"""The base install is a light recording SDK: in a venv with `pip install kvtrace` and the
`openai` package only (no torch, no server, no MCP), an openai-SDK agent records through the
transport, and the store's commands (log, show, export, import, diff) work; a command that
needs an extra says which, in one line. It installs from the package index (about 30 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
AGENT = textwrap.dedent("""
    import sys

    import httpx
    import openai

    from kvtrace import open_store
    from kvtrace.tracer import RecordingTransport
    from tests.canned import CannedUpstream

    server = CannedUpstream().start()
    store = open_store(sys.argv[1])
    transport = RecordingTransport(store.run("agent"))
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0,
                           http_client=httpx.Client(transport=transport))
    question = [{"role": "user", "content": "Weather in Paris?"}]
    answer = client.chat.completions.create(model="canned-model", messages=question)
    print(answer.choices[0].message.tool_calls[0].function.name)
    heavy = [name for name in ("torch", "fastapi", "mcp") if name in sys.modules]
    print("loaded:", heavy)
    store.close()
    server.stop()
""")


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", str(REPO), "openai"],
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-2000:]
    return venv


def _run(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=venv.parent,
                          timeout=300)


def test_the_base_install_records_and_reads_runs_without_torch(light_venv, tmp_path):
    python, kvtrace = str(light_venv / "bin" / "python"), str(light_venv / "bin" / "kvtrace")
    for heavy in ("torch", "transformers", "fastapi", "uvicorn", "mcp"):
        found = _run(light_venv, python, "-c", f"import importlib.util as u; "
                     f"print(u.find_spec('{heavy}') is None)")
        assert found.stdout.strip() == "True", f"{heavy} came with the base install"

    url = f"sqlite:///{tmp_path / 'light.db'}"
    agent = _run(light_venv, python, "-c", AGENT, url)
    assert agent.returncode == 0, agent.stderr
    assert agent.stdout.splitlines() == ["get_weather", "loaded: []"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return _run(light_venv, kvtrace, "--store", url, *args)

    assert "get_weather" in cli("log", "agent").stdout
    assert '"Weather in Paris?"' in cli("show", "agent").stdout
    exported = tmp_path / "agent.json"
    assert cli("export", "agent", "--format", "openai", "-o", str(exported)).returncode == 0
    assert cli("import", str(exported), "--format", "openai", "--run", "copy").returncode == 0
    diff = cli("diff", "agent", "copy")
    assert diff.returncode == 0, diff.stderr
    assert "same content at every position" in diff.stdout


@pytest.mark.parametrize(("command", "extra"), [
    (["serve"], "serve"), (["ui"], "ui"), (["mcp"], "mcp"), (["bench", "cache"], "engine")])
def test_a_command_that_needs_an_extra_names_it_in_one_line(light_venv, tmp_path, command,
                                                            extra):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    kvtrace = str(light_venv / "bin" / "kvtrace")
    assert _run(light_venv, kvtrace, "--store", url, "init").returncode == 0
    result = _run(light_venv, kvtrace, "--store", url, *command)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: kvtrace {' '.join(command)} needs the '{extra}' extra")
    assert f"pip install 'kvtrace[{extra}]'" in lines[0]
