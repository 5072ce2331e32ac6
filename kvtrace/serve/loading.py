"""The local engine loading while the server already answers: `serve` and `record` start at once.

Why: a fresh process spends seconds before the engine can answer (importing
torch and transformers, reading the weights, the load's probes, and with
`--from RUN@K` warming the KV of the recorded prefix; docs/benchmarks.md,
"The start, cut"). None of that is needed to answer what the recording
answers: a fork's first K calls (fromrun.py), or to let the agent's program
start, import its SDK and run its tools. So the server starts first and
`LoadingAnswerer` loads the backend on a thread of its own (`start`, which
`make_server` calls once its checks passed); a request that needs the model
waits for the load, and the start overlaps the agent's own.

What is known before the load is the model's name (engine/folders.py names
the folder without importing torch), so the banner and `--strict-model`'s
schema need not wait. `GET /v1/models` does wait: a client that waits for it
to answer (the benchmarks' `servers.py`, as for vLLM and llama.cpp) means
"until the model can answer". A load that fails answers every
later request with a 503 naming the failure; `wait_loaded` (serve) and
`raise_failed_load` (record) raise it for the CLI's exit line. A server that
stops waits for a load under way (a loader left running would build its
model beside whatever the process builds next; folders.py's `LOADING`),
unless it was told not to (`abandon_loads`: `serve`'s Ctrl-C, in a process
about to end); the loader then frees what it loaded when it ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtrace.errors import KvtraceError
from kvtrace.serve.request import APIError

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from kvtrace.replay.backend import DiskFaults
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve.answerer import Answerer
    from kvtrace.serve.recording import Sink


@dataclass(frozen=True, slots=True)
class BackendLoad:
    """A local backend to load once the server has started: its model's name, known before,
    and the call that loads it (and warms it, with `--from`); `make_server` takes it where it
    takes a backend."""

    model: str
    load: Callable[[], LocalBackend]


class StoppedBeforeLoadError(KvtraceError):
    """The server stopped while its model was loading: nothing needed it, nothing failed."""


class LoadingAnswerer:
    """A `LocalAnswerer` built on a background thread; requests wait for it (module docstring)."""

    def __init__(self, model: str, build: Callable[[], Answerer], *,
                 strict_model: bool = False) -> None:
        self._model = model
        self._strict_model = strict_model
        self._build = build
        self._built: Future[Answerer] = Future()
        # Running from the start: a waiting request that is cancelled must not cancel the
        # load the others wait for (asyncio.wrap_future passes a cancel on).
        self._built.set_running_or_notify_cancel()
        self._lock = threading.Lock()  # the load's end against `abandon`
        self._is_closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start loading (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._load, name="kvtrace-load", daemon=True)
            self._thread.start()

    def _load(self) -> None:
        try:
            built = self._build()
        except BaseException as exc:  # handed to whoever waits (`wait`, `answer`)
            self._built.set_exception(exc)
            return
        with self._lock:
            if not self._is_closed:
                self._built.set_result(built)
                return
        asyncio.run(built.close())  # abandoned meanwhile: the process is ending (`abandon`)
        self._built.set_exception(StoppedBeforeLoadError(
            f"the server stopped before the local model {self._model} loaded"))

    def wait(self) -> Answerer:
        """The loaded answerer, once the load ends; the load's own error when it failed."""
        self.start()
        return self._built.result()

    def has_ended(self, timeout: float) -> bool:
        """Whether the load ended (loaded or failed) within `timeout` seconds."""
        try:
            self._built.exception(timeout=timeout)
        except TimeoutError:
            return False
        return True

    def failure(self) -> BaseException | None:
        """The error the load ended with (None: it loaded, or it has not ended)."""
        if not self._built.done():
            return None
        failed = self._built.exception()
        return None if isinstance(failed, StoppedBeforeLoadError) else failed

    async def loaded(self) -> Answerer:
        """The loaded answerer, awaited; a failed load is a 503 naming why."""
        self.start()
        try:
            return await asyncio.wrap_future(self._built)
        except Exception as exc:
            raise APIError(503, f"the local model {self._model} did not load: {exc} (kvtrace's "
                           "own error line says so too: fix the model, then start again)",
                           kind="server_error", code="model_not_loaded") from exc

    def _ready(self) -> Answerer | None:
        """The loaded answerer, without waiting (None: loading, or failed)."""
        if self._built.done() and self._built.exception() is None:
            return self._built.result()
        return None

    @property
    def model(self) -> str:
        return self._model

    @property
    def required_model(self) -> str | None:
        return self._model if self._strict_model else None

    @property
    def description(self) -> str:
        ready = self._ready()
        return ready.description if ready is not None else f"local model {self._model}"

    def health(self) -> dict[str, Any]:
        ready = self._ready()
        if ready is not None:
            return ready.health()
        if not self._built.done():
            return {"mode": "local", "model": self._model, "loading": True}
        return {"status": "error", "mode": "local", "model": self._model, "loading": False,
                "error": str(self._built.exception())}

    def take_cache_faults(self) -> DiskFaults | None:
        ready = self._ready()
        return ready.take_cache_faults() if ready is not None else None

    async def answer(self, request: Request, body: bytes, sink: Sink) -> Response:
        return await (await self.loaded()).answer(request, body, sink)

    def abandon(self) -> None:
        """Let `close` return without waiting for a load under way (`_load` frees it)."""
        with self._lock:
            self._is_closed = True

    async def close(self) -> None:
        """Frees the loaded answerer, once a load under way ends (unless abandoned)."""
        with self._lock:
            if self._is_closed and not self._built.done():
                return
        if self._thread is not None:
            try:
                await asyncio.wrap_future(self._built)
            except Exception:  # the load's failure, said where it is asked for
                return
        ready = self._ready()
        if ready is not None:
            await ready.close()


def _loading(answerer: Answerer) -> list[LoadingAnswerer]:
    """The models `answerer` loads in the background, behind `FromRecording` and `ByAgent`."""
    inner = getattr(answerer, "inner", answerer)  # FromRecording's
    return [part for part in getattr(inner, "answerers", [inner])  # ByAgent's
            if isinstance(part, LoadingAnswerer)]


def start_loading(answerer: Answerer) -> None:
    """Start every load `answerer` holds (make_server, once its checks passed)."""
    for part in _loading(answerer):
        part.start()


def abandon_loads(answerer: Answerer) -> None:
    """Stop without waiting for the loads under way (the process is about to end)."""
    for part in _loading(answerer):
        part.abandon()


def wait_loaded(answerer: Answerer, until: threading.Event | None = None) -> bool:
    """Wait for every model `answerer` loads (none: returns at once); raises the first failed
    load's error. False: `until` was set first (a signal to `serve`: stop, loaded or not)."""
    for part in _loading(answerer):
        part.start()
        while until is not None and not part.has_ended(timeout=0.2):
            if until.is_set():
                return False
        part.wait()
    return True


async def until_loaded(answerer: Answerer) -> None:
    """`wait_loaded` for a request (FromRecording's first live one: before its fork is made);
    a failed load is a 503."""
    for part in _loading(answerer):
        await part.loaded()


def raise_failed_load(answerer: Answerer) -> None:
    """Raise the error of a load that failed (record, after the server stopped and so waited
    for it: a load nothing needed still ends before the process does)."""
    for part in _loading(answerer):
        failed = part.failure()
        if failed is not None:
            raise failed
