"""The local engine loading while the server already answers: `serve` and `record` start at once.

Why: a fresh process spends seconds before the engine can answer (importing
torch and transformers, reading the weights, the load's probes, and with
`--from RUN@K` warming the KV of the recorded prefix; docs/benchmarks.md,
"Where the start goes"). None of that is needed to answer what the
recording answers: a fork's first K calls (fromrun.py), or to let the
agent's program start, import its SDK and run its tools. So the server
starts first and `LoadingAnswerer` loads the backend on a thread of its own;
a request that needs the model waits for the load, and the start overlaps
the agent's own.

What is known before the load is the model's name (engine/folders.py names
the folder without importing torch), so the banner, `/v1/models` and
`--strict-model` need not wait. A load that fails answers every later request
with a 503 naming the failure, and `wait` raises it for the CLI's exit line.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


class LoadingAnswerer:
    """A `LocalAnswerer` built on a background thread; requests wait for it (module docstring)."""

    def __init__(self, model: str, build: Callable[[], Answerer], *,
                 strict_model: bool = False) -> None:
        self._model = model
        self._strict_model = strict_model
        self._built: Future[Answerer] = Future()
        self._thread = threading.Thread(target=self._build, args=(build,),
                                        name="kvtrace-load", daemon=True)
        self._thread.start()

    def _build(self, build: Callable[[], Answerer]) -> None:
        try:
            self._built.set_result(build())
        except BaseException as exc:  # handed to whoever waits (`wait`, `answer`)
            self._built.set_exception(exc)

    def wait(self) -> Answerer:
        """The loaded answerer, once the load ends; the load's own error when it failed."""
        return self._built.result()

    @property
    def is_loaded(self) -> bool:
        return self._built.done() and self._built.exception() is None

    def _loaded(self) -> Answerer | None:
        return self._built.result() if self.is_loaded else None

    @property
    def model(self) -> str:
        return self._model

    @property
    def required_model(self) -> str | None:
        return self._model if self._strict_model else None

    @property
    def description(self) -> str:
        loaded = self._loaded()
        return loaded.description if loaded is not None else f"local model {self._model}"

    def health(self) -> dict[str, Any]:
        loaded = self._loaded()
        if loaded is not None:
            return loaded.health()
        state: dict[str, Any] = {"mode": "local", "model": self._model, "loading": True}
        if self._built.done():
            state = {**state, "loading": False, "error": str(self._built.exception())}
        return state

    def take_cache_faults(self) -> DiskFaults | None:
        loaded = self._loaded()
        return loaded.take_cache_faults() if loaded is not None else None

    async def answer(self, request: Request, body: bytes, sink: Sink) -> Response:
        try:
            loaded = await asyncio.wrap_future(self._built)
        except Exception as exc:
            raise APIError(503, f"the local model {self._model} did not load: {exc}",
                           kind="server_error", code="model_not_loaded") from exc
        return await loaded.answer(request, body, sink)

    async def close(self) -> None:
        """Waits for a load under way (its engine thread is stopped with the answerer)."""
        try:
            loaded = await asyncio.wrap_future(self._built)
        except Exception:  # nothing was built, nothing to free
            return
        await loaded.close()


def wait_loaded(answerer: Answerer) -> None:
    """Wait for every model `answerer` loads in the background, behind `FromRecording` and
    `ByAgent` too (none: returns at once); raises the first failed load's error."""
    inner = getattr(answerer, "inner", answerer)  # FromRecording's
    for part in getattr(inner, "answerers", [inner]):  # ByAgent's
        if isinstance(part, LoadingAnswerer):
            part.wait()
