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

`run_command` runs `kvtrace record`'s program: SIGTERM and SIGINT sent to
this process go on to the program, which is waited for, so the server it
talks to stops only after it (never an orphan pointed at a dead server).
SIGINT is not sent on when this process is the terminal's foreground
group: a Ctrl-C there reached the program already. `is_loopback` tells
whether an address is reachable only from this machine.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
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

    def wait_for_signal(self) -> None:
        """Block until SIGINT or SIGTERM (or the server's end), leaving the stop to the caller
        (`kvtrace ui` first ends its open event streams, which the server would wait for).

        The handlers are set here rather than inherited: a shell starts a
        background job with SIGINT ignored, and a server that is sent SIGINT
        (or SIGTERM, as a service manager does) must still stop, and say what
        it recorded.
        """
        stopping = threading.Event()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {signum: signal.signal(signum, lambda *_: stopping.set())
                        for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self._thread.is_alive() and not stopping.is_set():
                self._thread.join(timeout=0.2)
        except KeyboardInterrupt:
            pass
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


def run_command(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run `command` to its end, passing SIGTERM and SIGINT on (module docstring).

    Returns its exit code, 128 + N when signal N ended it (as a shell reports it).
    """
    try:
        child = subprocess.Popen(list(command), env=dict(env))
    except FileNotFoundError as exc:
        raise UsageError(f"cannot run {command[0]!r}: no such program") from exc

    def forward(signum: int, _: FrameType | None) -> None:
        if signum == signal.SIGINT and _is_foreground():
            return  # the terminal sent it to the program's process group too
        child.send_signal(signum)

    is_main = threading.current_thread() is threading.main_thread()  # where handlers can be
    previous = {signum: signal.signal(signum, forward)
                for signum in (signal.SIGINT, signal.SIGTERM) if is_main}
    try:
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code


def _is_foreground() -> bool:
    """Whether this process's group is its terminal's foreground group (Ctrl-C reaches all)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):  # no terminal: the signal came from a program
        return False
