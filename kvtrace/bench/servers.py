"""Model servers in their own processes, started fresh for one benchmark case.

A benchmark that times a server should time it as a user runs it: `kvtrace
serve` in a process of its own (its engine loaded on the thread that
decodes, which the benchmark's own process, having loaded and used the
model already, could not give it; kvtrace/engine/batch.py), or llama.cpp's
server from the integration build. Each is started with nothing cached
(kvtrace: a new KV cache folder, the converted model reused) and stopped
when the case is over.

`kvtrace serve` runs the kvtrace this process imported, wherever it was
started: `python -m kvtrace` would import the working directory's first,
so a bench of a worktree's code run from the main checkout once timed the
worktree's client against main's server (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

START_TIMEOUT_S = 300.0  # a model load on a busy 2-core machine


@contextmanager
def kvtrace_serve(folder: Path, *, model: str | None, cache_dir: Path,
                  dtype: str = "float32") -> Iterator[str]:
    """`kvtrace serve` on the local model (in `dtype`) with an empty KV cache and a store in
    `folder`; yields its base URL (…/v1)."""
    from kvtrace.engine.folders import model_folder

    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [sys.executable, "-m", "kvtrace", "--store", f"sqlite:///{folder}/serve.db",
               "serve", "--port", str(port),
               "--model", str(model_folder(model, cache_dir).resolve()), "--dtype", dtype]
    env = {**os.environ, "KVTRACE_CACHE": str(folder / "cache"),
           "PYTHONPATH": server_pythonpath(os.environ.get("PYTHONPATH", ""))}
    with _process(command, env, port, folder / "server.log", cwd=folder) as url:
        yield url


@contextmanager
def llama_cpp_server(folder: Path, *, model: str | None, alias: str, n_ctx: int = 8192,
                     llama_python: Path | None = None) -> Iterator[str]:
    """llama-cpp-python's server on `model`'s GGUF (default: the embedded model's), on
    every core; yields its base URL (…/v1)."""
    from kvtrace.engine.folders import default_gguf

    python = llama_python or Path(".venv-llama/bin/python")
    if not python.exists():
        raise FileNotFoundError(f"no llama-cpp-python at {python}: `make test-integration` "
                                "builds it into .venv-llama")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    gguf = Path(model) if model is not None else default_gguf()
    command = [str(python), "-m", "llama_cpp.server", "--model", str(gguf),
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx),
               "--n_threads", str(os.cpu_count() or 1), "--model_alias", alias]
    with _process(command, dict(os.environ), port, folder / "server.log") as url:
        yield url


VLLM_PYTHON = Path(".venv-vllm/bin/python")  # `make bench-peers` installs vLLM's CPU build there


@contextmanager
def vllm_server(folder: Path, *, model: str | None, cache_dir: Path, alias: str,
                dtype: str = "float32", block_size: int | None = None,
                vllm_python: Path | None = None) -> Iterator[str]:
    """vLLM's CPU build (`make bench-peers`) on `model`'s folder (the one kvtrace converts), as
    the engine issue compares it: automatic prefix caching, cached tokens in its usage, its
    dev-mode `/reset_prefix_cache` (so each trial can start cold), a KV space of 4 GiB, one
    OpenMP thread per core; `block_size` None: its CPU build's default (128). Yields its base
    URL (…/v1). The first start compiles for ~100 s; later ones reuse the compile cache."""
    from kvtrace.engine.folders import model_folder

    python = vllm_python or VLLM_PYTHON
    if not python.exists():
        raise FileNotFoundError(f"no vLLM at {python}: `make bench-peers` installs its CPU "
                                "build into .venv-vllm")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cores = os.cpu_count() or 1
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_folder(model, cache_dir).resolve()),
               "--served-model-name", alias, "--dtype", dtype,
               "--host", "127.0.0.1", "--port", str(port),
               "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    if block_size is not None:
        command += ["--block-size", str(block_size)]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "4",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    with _process(command, env, port, folder / "server.log", start_timeout_s=600.0) as url:
        yield url


def dtype_name(dtype: Any) -> str:
    """A number format's name as both servers take it ("auto" resolved on this machine: vLLM
    reads "auto" as the model's own)."""
    import torch

    from kvtrace.engine.model import resolve_dtype

    resolved = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype,
                                                                         torch.device("cpu"))
    return str(resolved).removeprefix("torch.")


def server_pythonpath(inherited: str) -> str:
    """The PYTHONPATH a bench's `kvtrace serve` gets: this process's kvtrace first (unless it
    is an installed one, which the server finds anyway), then `inherited`, made absolute (the
    server runs in its own folder)."""
    ours = Path(__file__).resolve().parents[2]  # the folder holding this kvtrace package
    entries = [os.path.abspath(p) for p in inherited.split(os.pathsep) if p]
    if ours.name != "site-packages":
        entries.insert(0, str(ours))
    return os.pathsep.join(entries)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _process(command: list[str], env: dict[str, str], port: int, log: Path,
             cwd: Path | None = None, start_timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """The server in a process group of its own, stopped with every process it started (vLLM's
    engine and worker processes)."""
    url = f"http://127.0.0.1:{port}/v1"
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=cwd, start_new_session=True)
        try:
            _wait_listening(url, process, log, start_timeout_s)
            yield url
        finally:
            # A server still computing an abandoned request may linger: SIGKILL after 10 s.
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
            _signal_group(process, signal.SIGKILL)  # children its leader left behind


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _wait_listening(url: str, process: subprocess.Popen[bytes], log: Path,
                    timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
