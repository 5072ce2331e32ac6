"""Transports that record every exchange of any httpx- or httpx2-based client.

    client = openai.OpenAI(http_client=httpx.Client(transport=RecordingTransport(run)))
    client = anthropic.Anthropic(http_client=httpx2.Client(transport=RecordingTransport(run)))

One class serves both libraries (clients.py says how). `RecordingTransport(run,
inner=None)` hands each request to `inner` (by default a plain
`HTTPTransport()` of the request's library) and returns the response with its
body wrapped: the bytes pass through to the client as they arrive (an SSE
stream stays a stream), and the exchange is recorded (capture.py) once the
body has been read to its end or the client closes it, whichever comes
first. A chat stream closed before its end (and before `data: [DONE]`) is
recorded as abandoned, with what had arrived; an Anthropic or Responses
stream is complete when its terminal event arrived (capture.py). The bodies recorded are
content-decoded; the client receives the upstream's bytes unchanged.
`AsyncRecordingTransport` is the same for `httpx.AsyncClient` and
`httpx2.AsyncClient`.

Inside `with kvtrace.replaying(run, until=K)` (replay_mode.py) the session
decides first: a request that is the recording's next call is answered
from the recording (nothing sent, nothing recorded), and any other is sent
and recorded on the session's fork instead of this transport's run.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import httpx

from kvtrace.apis import chat
from kvtrace.store import Run
from kvtrace.tracer.capture import record_exchange
from kvtrace.tracer.clients import AsyncStream, SyncStream, default_transport
from kvtrace.tracer.context import current_replaying
from kvtrace.tracer.exchange import Exchange, decoded_body
from kvtrace.tracer.recorder import Recorder, as_recorder
from kvtrace.tracer.redact import Redactor


class _Capture:
    """What a wrapped response body has seen, and the one-time recording of it."""

    def __init__(self, request: httpx.Request, response: httpx.Response, started: float) -> None:
        self._request = request
        self._response = response
        self._started = started
        self._chunks: list[bytes] = []
        self._first_byte_s: float | None = None
        self._is_done = False

    def add(self, chunk: bytes) -> None:
        if self._first_byte_s is None:
            self._first_byte_s = time.perf_counter() - self._started
        self._chunks.append(chunk)

    def exchange(self, *, exhausted: bool) -> Exchange | None:
        """The exchange to record, once (None after the first call)."""
        if self._is_done:
            return None
        self._is_done = True
        raw = b"".join(self._chunks)
        body = decoded_body(self._response.headers, raw)
        complete = exhausted or (
            self._response.headers.get("content-type", "").startswith("text/event-stream")
            and chat.is_finished(body)
        )
        return Exchange(
            method=self._request.method,
            url=str(self._request.url),
            request_headers=tuple(self._request.headers.multi_items()),
            request_body=self._request.content,
            status=self._response.status_code,
            response_headers=tuple(self._response.headers.multi_items()),
            response_body=body,
            is_complete=complete,
            total_s=time.perf_counter() - self._started,
            first_byte_s=self._first_byte_s,
        )


class _RecordingStream(SyncStream):
    def __init__(self, inner: Iterable[bytes], capture: _Capture,
                 record: Callable[[Exchange], Any], close: Callable[[], None]) -> None:
        self._inner = inner
        self._capture = capture
        self._record = record
        self._close = close

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._capture.add(chunk)
            yield chunk
        self._finish(exhausted=True)

    def close(self) -> None:
        try:
            self._close()
        finally:
            self._finish(exhausted=False)

    def _finish(self, *, exhausted: bool) -> None:
        exchange = self._capture.exchange(exhausted=exhausted)
        if exchange is not None:
            self._record(exchange)


class _AsyncRecordingStream(AsyncStream):
    def __init__(self, inner: Any, capture: _Capture,
                 record: Callable[[Exchange], Any], close: Callable[[], Any]) -> None:
        self._inner = inner
        self._capture = capture
        self._record = record
        self._close = close

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._capture.add(chunk)
            yield chunk
        await self._finish(exhausted=True)

    async def aclose(self) -> None:
        try:
            await self._close()
        finally:
            await self._finish(exhausted=False)

    async def _finish(self, *, exhausted: bool) -> None:
        import anyio.to_thread

        exchange = self._capture.exchange(exhausted=exhausted)
        if exchange is not None:
            await anyio.to_thread.run_sync(self._record, exchange)


class RecordingTransport:
    """Records every exchange into `run` (a Run or Recorder); see the module docstring.

    `redact_headers` adds header names whose values must never be stored.
    """

    def __init__(self, run: Run | Recorder, inner: Any = None, *,
                 redact_headers: Iterable[str] = ()) -> None:
        self.recorder = as_recorder(run)
        self.inner = inner  # None: a plain transport of each request's library, made on first use
        self._defaults: dict[type, Any] = {}
        self.redactor = Redactor(redact_headers)

    def __enter__(self) -> RecordingTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def record(self, exchange: Exchange, recorder: Recorder | None = None) -> None:
        record_exchange(recorder or self.recorder, exchange, self.redactor)

    def _default(self, request: httpx.Request) -> Any:
        if type(request) not in self._defaults:
            self._defaults[type(request)] = default_transport(request, is_async=False)
        return self._defaults[type(request)]

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        recorder = self.recorder
        session = current_replaying()
        if session is not None:
            taken = session.take_request(request)
            if not isinstance(taken, Recorder):
                return taken
            recorder = taken
        started = time.perf_counter()
        inner = self.inner if self.inner is not None else self._default(request)
        response = inner.handle_request(request)
        capture = _Capture(request, response, started)
        if not isinstance(response.stream, Iterable):
            raise TypeError("the inner transport of a sync client returned an async stream")
        stream = _RecordingStream(response.stream, capture,
                                  lambda exchange: self.record(exchange, recorder),
                                  response.close)
        return type(response)(response.status_code, headers=response.headers, stream=stream,
                              extensions=response.extensions)

    def close(self) -> None:
        for transport in [self.inner, *self._defaults.values()]:
            if transport is not None:
                transport.close()


class AsyncRecordingTransport:
    """The async twin of RecordingTransport, for `httpx.AsyncClient` and `httpx2.AsyncClient`."""

    def __init__(self, run: Run | Recorder, inner: Any = None, *,
                 redact_headers: Iterable[str] = ()) -> None:
        self.recorder = as_recorder(run)
        self.inner = inner
        self._defaults: dict[type, Any] = {}
        self.redactor = Redactor(redact_headers)

    async def __aenter__(self) -> AsyncRecordingTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def record(self, exchange: Exchange, recorder: Recorder | None = None) -> None:
        record_exchange(recorder or self.recorder, exchange, self.redactor)

    def _default(self, request: httpx.Request) -> Any:
        if type(request) not in self._defaults:
            self._defaults[type(request)] = default_transport(request, is_async=True)
        return self._defaults[type(request)]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        recorder = self.recorder
        session = current_replaying()
        if session is not None:
            import anyio.to_thread

            taken = await anyio.to_thread.run_sync(session.take_request, request)
            if not isinstance(taken, Recorder):
                return taken
            recorder = taken
        started = time.perf_counter()
        inner = self.inner if self.inner is not None else self._default(request)
        response = await inner.handle_async_request(request)
        capture = _Capture(request, response, started)
        stream = _AsyncRecordingStream(response.stream, capture,
                                       lambda exchange: self.record(exchange, recorder),
                                       response.aclose)
        return type(response)(response.status_code, headers=response.headers, stream=stream,
                              extensions=response.extensions)

    async def aclose(self) -> None:
        for transport in [self.inner, *self._defaults.values()]:
            if transport is not None:
                await transport.aclose()
