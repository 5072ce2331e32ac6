"""A real third-party OpenAI-compatible server: llama.cpp's, from llama-cpp-python.

These tests run under `make test-integration` (which sets KVTRACE_INTEGRATION=1
and builds llama-cpp-python[server] into its own venv, `.venv-llama`, so its
pins never touch kvtrace's); `make test` skips them. When the build failed,
every test here skips saying why and where the build log is.
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


def _why_unavailable() -> str | None:
    if not os.environ.get("KVTRACE_INTEGRATION"):
        return "integration tests run with `make test-integration`"
    if not LLAMA_PYTHON.exists():
        return f"llama-cpp-python is not installed: no {LLAMA_PYTHON} (see {BUILD_LOG})"
    check = subprocess.run([str(LLAMA_PYTHON), "-c", "import llama_cpp.server"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        return (f"llama-cpp-python[server] does not import in {LLAMA_PYTHON}: "
                f"{check.stderr.strip().splitlines()[-1:]} (build log: {BUILD_LOG})")
    return None


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory) -> Iterator[str]:
    """The base URL (…/v1) of a running llama.cpp server with the default model's GGUF."""
    reason = _why_unavailable()
    if reason:
        pytest.skip(reason)
    from kvtrace.bench.servers import llama_cpp_server

    with llama_cpp_server(tmp_path_factory.mktemp("llama"), model=None, alias="smollm2",
                          n_ctx=4096, llama_python=LLAMA_PYTHON) as url:
        yield url
