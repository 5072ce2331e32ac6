"""Deterministic replay of recorded exchanges: `ReplayTransport` and its async twin.

    client = openai.OpenAI(http_client=httpx.Client(transport=ReplayTransport(run)))
    client = anthropic.Anthropic(http_client=httpx2.Client(transport=ReplayTransport(run)))

The recording is the run's steps from its root to its head, like a VCR
cassette: a request is matched to a recorded exchange (matching.py: the
same API, path, conversation, system prompt, tools, model and params, or
for plain HTTP the same method, URL and body) and answered with what the
step recorded (served.py). Modes (`CassetteMode`):

- `none`: only the recording answers; an unrecorded request gets a 404
  response whose JSON error body (in the shape of the API it was sent to)
  names the closest recorded request and how it differs, with
  `x-should-retry: false`: an SDK shows it as it is (`openai.NotFoundError`,
  `anthropic.NotFoundError`) and does not retry (a 404 is never
  retried; a 409 would be). `on_unrecorded="raise"` raises
  UnrecordedRequestError instead, for direct httpx users who want an
  exception (an SDK would wrap it in a connection error and retry);
- `new_episodes`: unrecorded requests go to `inner` and are recorded;
- `all`: every request goes to `inner` and is recorded (re-recording).

With `until=K` (mode `new_episodes`), steps 1..K are answered from the
recording in order and the rest go live on a fork (prefix.py). The two
transports decide alike (`_Replay`); they differ only in how they wait.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any, TypeVar

import httpx

from kvtrace.errors import UnrecordedRequestError, UsageError
from kvtrace.store import Run, Step
from kvtrace.tracer.matching import Cassette, request_key
from kvtrace.tracer.recorder import Recorder, as_recorder
from kvtrace.tracer.redact import Redactor
from kvtrace.tracer.served import (
    UNRECORDED_STATUS,
    recorded_completion,
    served_response,
    unrecorded_response,
)
from kvtrace.tracer.transport import AsyncRecordingTransport, RecordingTransport

# The names programs import from here, beside those defined here (matching.py and served.py
# hold the rest).
__all__ = [
    "UNRECORDED_STATUS",
    "AsyncReplayTransport",
    "Cassette",
    "CassetteMode",
    "OnUnrecorded",
    "ReplayTransport",
    "recorded_completion",
    "request_key",
    "served_response",
    "unrecorded_response",
]

_Choice = TypeVar("_Choice", bound=StrEnum)


class CassetteMode(StrEnum):
    NONE = "none"
    NEW_EPISODES = "new_episodes"
    ALL = "all"


class OnUnrecorded(StrEnum):
    """What mode `none` does with a request the recording does not hold."""

    RESPOND = "respond"  # a 404 with a JSON error body, not to be retried
    RAISE = "raise"  # UnrecordedRequestError from the transport


class _Replay:
    """What both transports hold and decide: the recording, the mode, the prefix."""

    def __init__(self, run: Run | Recorder, mode: str = CassetteMode.NONE,
                 inner: Any = None, *,
                 redact_headers: Iterable[str] = (),
                 on_unrecorded: str = OnUnrecorded.RESPOND,
                 until: int | None = None, fork: str | None = None,
                 edit: Mapping[str, Any] | None = None) -> None:
        self.mode = _mode(mode)
        self.on_unrecorded = _on_unrecorded(on_unrecorded)
        self.recorder = as_recorder(run)
        self._redact_headers = tuple(redact_headers)
        self.cassette = Cassette(_steps(self.recorder), Redactor(redact_headers))
        self.prefix = _prefix(self.recorder, self.mode, until, fork, edit, self._redact_headers)
        self._inner = inner

    def _answer(self, request: httpx.Request) -> httpx.Response | None:
        """The recording's answer to `request` (a 404 for a miss in mode `none`), or None:
        the request goes live."""
        if self.prefix is not None:
            step = self.prefix.serve(request)
            return served_response(step, request) if step is not None else None
        if self.mode != CassetteMode.ALL:
            step = self.cassette.find(request)
            if step is not None:
                return served_response(step, request)
            if self.mode == CassetteMode.NONE:
                return _unrecorded(request, self.cassette.explain_miss(request),
                                   self.on_unrecorded)
        return None


class ReplayTransport(_Replay):
    """Serves `run`'s recorded exchanges (see the module docstring for the modes)."""

    _live: RecordingTransport | None = None

    def __enter__(self) -> ReplayTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        answer = self._answer(request)
        if answer is not None:
            return answer
        if self._live is None:
            run = self.prefix.go_live() if self.prefix is not None else self.recorder
            self._live = RecordingTransport(run, self._inner,
                                            redact_headers=self._redact_headers)
        return self._live.handle_request(request)

    def close(self) -> None:
        if self._live is not None:
            self._live.close()


class AsyncReplayTransport(_Replay):
    """The async twin of ReplayTransport, for `httpx.AsyncClient` and `httpx2.AsyncClient`."""

    _live: AsyncRecordingTransport | None = None

    async def __aenter__(self) -> AsyncReplayTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        answer = self._answer(request)
        if answer is not None:
            return answer
        if self._live is None:
            run: Any = self.recorder
            if self.prefix is not None:
                import anyio.to_thread

                run = await anyio.to_thread.run_sync(self.prefix.go_live)
            self._live = AsyncRecordingTransport(run, self._inner,
                                                 redact_headers=self._redact_headers)
        return await self._live.handle_async_request(request)

    async def aclose(self) -> None:
        if self._live is not None:
            await self._live.aclose()


def _prefix(recorder: Recorder, mode: CassetteMode, until: int | None, fork: str | None,
            edit: Mapping[str, Any] | None, redact_headers: tuple[str, ...]) -> Any:
    """The RecordedPrefix of `until` (None without it): prefix.py, `--from` from Python."""
    if until is None:
        if fork is not None or edit is not None:
            raise UsageError("fork and edit go with until=K (answer steps 1..K from the "
                             "recording, then go live on a fork)", param="until")
        return None
    if mode is not CassetteMode.NEW_EPISODES:
        raise UsageError("until=K answers the first K steps from the recording and the rest "
                         "live: it goes with mode='new_episodes'", param="until")
    from kvtrace.tracer.prefix import RecordedPrefix

    return RecordedPrefix.of_run(recorder.store, recorder.name, until, fork=fork, edit=edit,
                                 redact_headers=redact_headers)


def _mode(mode: str) -> CassetteMode:
    return _member(CassetteMode, mode, "replay mode")


def _on_unrecorded(value: str) -> OnUnrecorded:
    return _member(OnUnrecorded, value, "on_unrecorded")


def _member(kind: type[_Choice], value: str, what: str) -> _Choice:
    try:
        return kind(value)
    except ValueError as exc:
        raise UsageError(
            f"{what} {value!r}: use one of {', '.join(m.value for m in kind)}"
        ) from exc


def _unrecorded(request: httpx.Request, message: str,
                on_unrecorded: OnUnrecorded) -> httpx.Response:
    if on_unrecorded == OnUnrecorded.RAISE:
        raise UnrecordedRequestError(message)
    return unrecorded_response(request, message)


def _steps(recorder: Recorder) -> list[Step]:
    head = recorder.run.refresh()
    return recorder.store.path(recorder.name) if head is not None else []
