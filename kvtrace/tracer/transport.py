"""httpx transports that record every exchange of any httpx-based client.

    client = openai.OpenAI(http_client=httpx.Client(transport=RecordingTransport(run)))

`RecordingTransport(run, inner=None)` hands each request to `inner` (a
plain `httpx.HTTPTransport()` by default) and returns the response with its
body wrapped: the bytes pass through to the client as they arrive (an SSE
stream stays a stream), and the exchange is recorded (exchange.py) once the
body has been read to its end or the client closes it, whichever comes
first. A stream closed before its end (and before `data: [DONE]`) is
recorded as abandoned, with what had arrived. The bodies recorded are
content-decoded; the client receives the upstream's bytes unchanged.
`AsyncRecordingTransport` is the same for `httpx.AsyncClient`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import httpx

from kvtrace.store import Run
from kvtrace.tracer import sse
from kvtrace.tracer.exchange import Exchange, decoded_body, record_exchange
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
            and sse.is_finished(body)
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


class _RecordingStream(httpx.SyncByteStream):
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


class _AsyncRecordingStream(httpx.AsyncByteStream):
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


class RecordingTransport(httpx.BaseTransport):
    """Records every exchange into `run` (a Run or Recorder); see the module docstring.

    `redact_headers` adds header names whose values must never be stored.
    """

    def __init__(self, run: Run | Recorder, inner: httpx.BaseTransport | None = None, *,
                 redact_headers: Iterable[str] = ()) -> None:
        self.recorder = as_recorder(run)
        self.inner = inner if inner is not None else httpx.HTTPTransport()
        self.redactor = Redactor(redact_headers)

    def record(self, exchange: Exchange) -> None:
        record_exchange(self.recorder, exchange, self.redactor)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        started = time.perf_counter()
        response = self.inner.handle_request(request)
        capture = _Capture(request, response, started)
        if not isinstance(response.stream, httpx.SyncByteStream):
            raise TypeError("the inner transport of a sync client returned an async stream")
        stream = _RecordingStream(response.stream, capture, self.record, response.close)
        return httpx.Response(response.status_code, headers=response.headers, stream=stream,
                              extensions=response.extensions)

    def close(self) -> None:
        self.inner.close()


class AsyncRecordingTransport(httpx.AsyncBaseTransport):
    """The async twin of RecordingTransport, for `httpx.AsyncClient`."""

    def __init__(self, run: Run | Recorder, inner: httpx.AsyncBaseTransport | None = None, *,
                 redact_headers: Iterable[str] = ()) -> None:
        self.recorder = as_recorder(run)
        self.inner = inner if inner is not None else httpx.AsyncHTTPTransport()
        self.redactor = Redactor(redact_headers)

    def record(self, exchange: Exchange) -> None:
        record_exchange(self.recorder, exchange, self.redactor)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        started = time.perf_counter()
        response = await self.inner.handle_async_request(request)
        capture = _Capture(request, response, started)
        stream = _AsyncRecordingStream(response.stream, capture, self.record, response.aclose)
        return httpx.Response(response.status_code, headers=response.headers, stream=stream,
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()
