"""Work a client waits for, stopped when the client leaves before its answer.

Once a request's body is read in full, the ASGI server's `receive()` blocks
until the connection closes, then says `http.disconnect` (uvicorn does so
for HTTP/1.1). `unless_client_leaves` awaits the work and that message side
by side: the work's result when it ends first; when the client leaves first,
the work is stopped — `stop()` when given (the engine's cancellation flag,
checked between decode steps), else by cancelling it (an upstream request:
httpx closes its connection) — waited for until it has ended, so that no
work runs for a client that is gone, and `client_left()` (499, nginx's
"client closed request") is raised. Nobody reads that answer; the point is
that nothing after it (a store write) runs. Used before the first byte of
an answer is sent.

A stream the client drops later is Starlette's to notice: it cancels the
task sending it, but leaves the stream's generator suspended, to be closed
whenever the garbage collector gets to it, so the generator's `finally`
(where a dropped stream is recorded incomplete, and its upstream request
closed) would run at no known time. `ClosingStream` closes it as the
response ends, however it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvtrace.serve.request import APIError

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499


def client_left() -> APIError:
    return APIError(CLIENT_CLOSED_REQUEST, "the client closed the connection before its answer "
                    "was ready: the work was stopped and nothing was recorded",
                    code="client_closed_request")


async def unless_client_leaves(request: Request, work: Awaitable[T], *,
                               stop: Callable[[], None] | None = None) -> T:
    """`await work`, unless the client leaves first (see the module docstring)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping: stop the work too
        watcher.cancel()
        await _stopped(task, stop)
        raise
    if task.done():  # ended first, or with the client's leaving: what it made is not lost
        watcher.cancel()
        return task.result()
    await _stopped(task, stop)
    raise client_left()


async def _stopped(task: asyncio.Future[T], stop: Callable[[], None] | None) -> None:
    """Stop `task` and wait until it has ended, whatever it ended with."""
    if stop is not None:
        stop()
    else:
        task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: its error (the cancellation's) is expected here


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClosingStream(StreamingResponse):
    """A streamed answer whose generator is closed when the response ends (module docstring)."""

    def __init__(self, events: AsyncIterator[bytes], *, status_code: int = 200,
                 headers: Mapping[str, str] | None = None, media_type: str | None = None) -> None:
        super().__init__(events, status_code=status_code, headers=headers, media_type=media_type)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
