"""Running the server: in the foreground (`kvtrace serve`) or on a background thread.

`BackgroundServer` binds a loopback socket first (port 0: the kernel picks a
free one, so there is no race between choosing a port and listening on
it), then runs uvicorn on a daemon thread and returns once it accepts
connections. `kvtrace record`, the benchmark and the tests use it.

`client_env` is that program's environment: the OpenAI SDKs pointed at
the server by `OPENAI_BASE_URL` (and the older `OPENAI_API_BASE`), with
`/v1`, and Anthropic's by `ANTHROPIC_BASE_URL`, without it (the anthropic
SDK, Claude Code and the Claude Agent SDK append `/v1/messages`
themselves); a placeholder key for each SDK that has none, since both
refuse to start without one (a key the user set is kept: in upstream mode
it travels to the upstream).

`run_command` runs `kvtrace record`'s program (`run_commands`, K of them
at once for `--n K`): SIGTERM and SIGINT sent to this process go on to the
program, which is waited for, so the server it talks to stops only after it
(never an orphan pointed at a dead server).
SIGINT is not sent on when this process is the terminal's foreground
group: a Ctrl-C there reached the program already. `is_loopback` tells
whether an address is reachable only from this machine.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from kvtrace.errors import TracerError, UsageError


class BackgroundServer:
    """An ASGI app served by uvicorn on a thread; `url` is its base URL (with /v1)."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without it, the second response on a
        # kept-alive connection waits ~40 ms (Nagle against the client's delayed ACK).
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise TracerError(f"cannot listen on {host}:{port} ({exc.strerror}): "
                              "pick another --port") from exc
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True,
                                        name="kvtrace-serve")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> BackgroundServer:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise TracerError("the server stopped while starting (see the log above)")
            self._thread.join(timeout=0.01)
        return self

    def wait(self) -> None:
        """Block until the server stops: SIGINT (Ctrl-C) or SIGTERM stops it gracefully."""
        self.wait_for_signal()
        self.stop()

    def wait_for_signal(self, stopping: threading.Event | None = None) -> None:
        """Block until SIGINT or SIGTERM (or the server's end), leaving the stop to the caller
        (`kvtrace ui` first ends its open event streams, which the server would wait for).
        `stopping`: the event of a `stop_signals` block the caller holds already."""
        if stopping is None:
            with stop_signals() as stopping:
                self.wait_for_signal(stopping)
            return
        try:
            while self._thread.is_alive() and not stopping.is_set():
                self._thread.join(timeout=0.2)
        except KeyboardInterrupt:
            pass

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def stop_signals() -> Iterator[threading.Event]:
    """For the block, SIGINT and SIGTERM set the event instead of what they did (on the main
    thread; elsewhere signals cannot be handled and the event only serves as a flag).

    The handlers are set here rather than inherited: a shell starts a
    background job with SIGINT ignored, and a server that is sent SIGINT (or
    SIGTERM, as a service manager does) must still stop, and say what it
    recorded, from its first moment on (`serve` holds the block while its
    model loads, too).
    """
    stopping = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, lambda *_: stopping.set())
                    for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopping
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or "localhost") is reachable only from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to any address
        return False


PLACEHOLDER_KEY = "kvtrace"


def client_env(environ: Mapping[str, str], url: str) -> dict[str, str]:
    """`environ` with the SDKs pointed at the server whose base URL (with /v1) is `url`."""
    env = dict(environ)
    env["OPENAI_BASE_URL"] = env["OPENAI_API_BASE"] = url
    env.setdefault("OPENAI_API_KEY", PLACEHOLDER_KEY)
    env["ANTHROPIC_BASE_URL"] = url.removesuffix("/v1")
    if not env.get("ANTHROPIC_API_KEY") and not env.get("ANTHROPIC_AUTH_TOKEN"):
        env["ANTHROPIC_API_KEY"] = PLACEHOLDER_KEY  # not beside a token: it would shadow it
    return env


def check_program(command: Sequence[str], cwd: str | None = None) -> None:
    """A UsageError now, before a model loads for seconds, when `command`'s program cannot be
    run: a bare name not on PATH, a path that is no executable file (relative to `cwd`
    where it is a known folder; a templated one, `{i}`, is left to the start)."""
    if not command:
        raise UsageError("name the program to run after '--'")
    program = command[0]
    if os.sep not in program:
        if shutil.which(program) is None:
            raise UsageError(f"cannot run {program!r}: no such program on PATH")
        return
    if cwd is not None and "{i}" in cwd:
        return
    path = Path(cwd or ".") / program
    if not path.is_file() or not os.access(path, os.X_OK):
        what = "no such program" if not path.exists() else "not an executable file"
        raise UsageError(f"cannot run {program!r}: {what}")


def run_command(command: Sequence[str], env: Mapping[str, str], *,
                cwd: Path | None = None) -> int:
    """Run `command` to its end, passing SIGTERM and SIGINT on (module docstring).

    Returns its exit code, 128 + N when signal N ended it (as a shell reports it).
    """
    [(code, _)] = run_commands([Child(command, env, cwd)])
    return code


@dataclass(frozen=True, slots=True)
class Child:
    """A program to run: its arguments, its environment, its working folder (None: ours)."""

    command: Sequence[str]
    env: Mapping[str, str]
    cwd: Path | None = None


def run_commands(children: Sequence[Child]) -> list[tuple[int, float]]:
    """Run the programs at once, each to its end, passing SIGTERM and SIGINT on to every one;
    per program, its exit code (as `run_command`'s) and the seconds it ran. A working folder
    that does not exist is made first."""
    for child in children:
        if child.cwd is not None:
            try:
                child.cwd.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"cannot make the working folder {child.cwd}: "
                                 f"{exc.strerror or exc}") from exc
    started = time.perf_counter()
    running: list[subprocess.Popen[bytes]] = []
    try:
        for child in children:
            running.append(subprocess.Popen(list(child.command), env=dict(child.env),
                                            cwd=child.cwd))
    except FileNotFoundError as exc:
        for process in running:
            process.kill()
            process.wait()
        raise UsageError(f"cannot run {children[0].command[0]!r}: no such program") from exc

    def forward(signum: int, _: FrameType | None) -> None:
        if signum == signal.SIGINT and _is_foreground():
            return  # the terminal sent it to the programs' process group too
        for process in running:
            if process.poll() is None:
                process.send_signal(signum)

    is_main = threading.current_thread() is threading.main_thread()  # where handlers can be
    previous = {signum: signal.signal(signum, forward)
                for signum in (signal.SIGINT, signal.SIGTERM) if is_main}
    ended: dict[int, tuple[int, float]] = {}
    try:
        while len(ended) < len(running):
            for index, process in enumerate(running):
                if index not in ended:
                    code = process.wait() if len(running) == 1 else process.poll()
                    if code is not None:
                        ended[index] = (128 - code if code < 0 else code,
                                        time.perf_counter() - started)
            if len(ended) < len(running):
                time.sleep(0.02)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return [ended[index] for index in range(len(running))]


def _is_foreground() -> bool:
    """Whether this process's group is its terminal's foreground group (Ctrl-C reaches all)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):  # no terminal: the signal came from a program
        return False
