"""The benches' `kvtrace serve` runs the kvtrace of the process that starts it
(kvtrace/bench/servers.py): a before/after bench of a worktree once timed main's server."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

import kvtrace
from kvtrace.bench.servers import kvtrace_serve, server_pythonpath


def test_the_bench_server_runs_this_kvtrace_not_the_working_directorys(
        tiny_model_folder, tmp_path, monkeypatch):
    decoy = tmp_path / "checkout"
    (decoy / "kvtrace").mkdir(parents=True)
    (decoy / "kvtrace" / "__init__.py").write_text("raise SystemExit('the decoy kvtrace ran')\n")
    (decoy / "kvtrace" / "__main__.py").write_text("raise SystemExit('the decoy kvtrace ran')\n")
    monkeypatch.chdir(decoy)  # `python -m kvtrace` started here would import the decoy
    with kvtrace_serve(tmp_path / "serve", model=str(tiny_model_folder),
                       cache_dir=tmp_path / "cache") as url:
        answer = httpx.post(f"{url}/chat/completions", timeout=120, json={
            "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["role"] == "assistant"


def test_the_bench_server_path_puts_this_kvtrace_first_and_makes_the_rest_absolute(tmp_path,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    entries = server_pythonpath(os.pathsep.join(["extra", "", "/opt/lib"])).split(os.pathsep)
    assert entries == [str(Path(kvtrace.__file__).resolve().parents[1]),  # kvtrace's parent
                       str(tmp_path / "extra"), "/opt/lib"]
