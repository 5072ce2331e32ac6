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
worktree's client against main's server (docs/benchmarks.md, session 19).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
             cwd: Path | None = None) -> Iterator[str]:
    url = f"http://127.0.0.1:{port}/v1"
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=cwd)
        try:
            _wait_listening(url, process, log)
            yield url
        finally:
            process.terminate()  # a server still computing an abandoned request may linger
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_listening(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
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
