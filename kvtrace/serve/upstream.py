"""The upstream answerer: every request goes on to another server (OpenAI, Anthropic, or alike).

The request is sent with httpx to the upstream base URL (`--upstream`, with
its API prefix, e.g. `http://host:port/v1`), and the upstream's status,
headers (less hop-by-hop ones, `Date` and `Server`) and body bytes come back
unchanged, an SSE stream passed on as it arrives. A request of the three
model-call APIs (chat completions, Anthropic Messages, OpenAI Responses) is
checked first (api.py, anthropic_api.py, responses_api.py), so bad input is
answered here and never forwarded. The client's credentials
(`Authorization`, Anthropic's `x-api-key`) go along unless
`forwards_authorization` is off (the server checks its own key: then they
are dropped) or the upstream has its own `api_key` (then that is sent
instead: as `x-api-key` under `/messages`, Anthropic's header, else as a
bearer token).

What is recorded is capture.py's model_call (or http) step, as the httpx
transports record it; a 4xx from the upstream is returned and not recorded.
A stream is recorded when its last event arrives (before it is passed on):
chat's `data: [DONE]`, Anthropic's `message_stop`, a Responses stream's
`response.completed`, `.incomplete` or `.failed`; or at its end when it has
none. A stream the client drops is recorded with what had arrived, marked
incomplete, and its upstream request closed.

The upstream gets `timeout` seconds for each wait (to connect, to send, for
the next bytes of its answer): past it, before any byte was passed on, the
client gets a 504 (`upstream_timeout`) and nothing is recorded; a stream
that stalls past it is ended, recorded incomplete. A client that leaves
before the answer starts has its upstream request closed (disconnect.py),
and nothing is recorded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from kvtrace.apis.chat import DONE
from kvtrace.errors import UsageError
from kvtrace.serve.anthropic_api import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    is_anthropic_path,
    parse_messages_request,
    stream_error_event,
)
from kvtrace.serve.api import CHAT_PATH, parse_chat_request
from kvtrace.serve.disconnect import ClosingStream, unless_client_leaves
from kvtrace.serve.recording import DISCARD, RUN_HEADER, Sink, StepWrite
from kvtrace.serve.request import APIError, failed_answer
from kvtrace.serve.responses_api import RESPONSES_PATH, parse_responses_request
from kvtrace.tracer.capture import record_exchange
from kvtrace.tracer.exchange import Exchange, decoded_body

_API_PREFIX = "/v1"
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
    "upgrade", "host", "content-length",
})
_NOT_RETURNED = frozenset({"connection", "keep-alive", "transfer-encoding", "date", "server"})
_CREDENTIALS = frozenset({"authorization", "x-api-key"})
# How each API's request is checked before it goes on.
_CHECKS: dict[str, Callable[[bytes], object]] = {
    CHAT_PATH: lambda body: parse_chat_request(body, is_local=False),
    MESSAGES_PATH: parse_messages_request,
    COUNT_TOKENS_PATH: lambda body: parse_messages_request(body, is_counted_only=True),
    RESPONSES_PATH: lambda body: parse_responses_request(body, is_local=False),
}
# The `event:` names that end a stream of Anthropic Messages or OpenAI Responses.
_LAST_EVENTS = (b"message_stop", b"response.completed", b"response.incomplete",
                b"response.failed")
DEFAULT_TIMEOUT_S = 600.0


class UpstreamAnswerer:
    """Forwards to `url` and returns what it answers (see the module docstring)."""

    def __init__(self, url: str, *, api_key: str | None = None,
                 forwards_authorization: bool = True,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"upstream {url!r} must start with http:// or https:// and end "
                             "with the API prefix (often /v1)")
        if not timeout > 0:  # NaN too
            raise UsageError(f"upstream_timeout must be a number of seconds > 0, not {timeout}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._api_key = api_key
        self._forwards_authorization = forwards_authorization and api_key is None
        self._client: httpx.AsyncClient | None = None

    @property
    def model(self) -> None:
        return None

    @property
    def required_model(self) -> None:
        return None

    @property
    def description(self) -> str:
        return f"upstream {self.url}"

    def take_cache_faults(self) -> None:
        return None

    def health(self) -> dict[str, Any]:
        return {"mode": "upstream", "upstream": self.url}

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def answer(self, request: Request, body: bytes, sink: Sink) -> Response:
        check = _CHECKS.get(request.url.path) if request.method == "POST" else None
        if check is not None:
            await asyncio.to_thread(check, body)
        started = time.perf_counter()
        url = self._url_of(request)
        response = await unless_client_leaves(request, self._send(request, url, body))
        if 400 <= response.status_code < 500:
            sink = DISCARD  # the upstream refused the request: returned, not recorded
        returned = {k: v for k, v in response.headers.items() if k.lower() not in _NOT_RETURNED}

        def step(raw: bytes, first_byte_s: float | None, *, is_complete: bool) -> StepWrite:
            exchange = Exchange(
                method=request.method, url=url,
                request_headers=tuple(request.headers.items()), request_body=body,
                status=response.status_code,
                response_headers=tuple(response.headers.multi_items()),
                response_body=decoded_body(response.headers, raw), is_complete=is_complete,
                total_s=time.perf_counter() - started, first_byte_s=first_byte_s,
            )
            return lambda recorder, redactor: record_exchange(recorder, exchange, redactor)

        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            raw = await unless_client_leaves(request, self._read(response))
            await sink.record(step(raw, None, is_complete=True))
            return Response(raw, status_code=response.status_code, headers=returned)

        async def relay() -> AsyncIterator[bytes]:
            chunks: list[bytes] = []
            first_byte_s: float | None = None
            is_recorded = False
            end = _StreamEnd()
            try:
                try:
                    async for chunk in response.aiter_raw():
                        if first_byte_s is None:
                            first_byte_s = time.perf_counter() - started
                        chunks.append(chunk)
                        if not is_recorded and end.feed(chunk):
                            is_recorded = True
                            await sink.record(step(b"".join(chunks), first_byte_s,
                                                   is_complete=True))
                        yield chunk
                    if not is_recorded:  # a stream without [DONE], read to its end
                        is_recorded = True
                        await sink.record(step(b"".join(chunks), first_byte_s,
                                               is_complete=True))
                except httpx.HTTPError as exc:  # the SDKs raise an SSE event holding "error"
                    yield stream_error_event(request.url.path, self._broken_off(exc))
                except APIError as exc:  # the run was paused meanwhile: refused, unrecorded
                    yield stream_error_event(request.url.path, exc)
                except Exception as exc:  # the store failed: app.py's 500, as an event
                    yield stream_error_event(request.url.path, failed_answer(
                        request.method, request.url.path, exc))
            finally:
                if not is_recorded:  # the client left early, or the upstream stalled
                    sink.record_later(step(b"".join(chunks), first_byte_s, is_complete=False))
                await response.aclose()

        return ClosingStream(relay(), status_code=response.status_code, headers=returned)

    def _url_of(self, request: Request) -> str:
        # the path as the client sent it, still percent-encoded: forwarded unchanged
        path = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")
        if path.startswith(_API_PREFIX):
            path = path[len(_API_PREFIX):]
        return self.url + path + (f"?{request.url.query}" if request.url.query else "")

    async def _send(self, request: Request, url: str, body: bytes) -> httpx.Response:
        headers = [(k, v) for k, v in request.headers.items()
                   if k.lower() not in _HOP_BY_HOP and k.lower() != RUN_HEADER]
        if not self._forwards_authorization:
            headers = [(k, v) for k, v in headers if k.lower() not in _CREDENTIALS]
        if self._api_key is not None:
            headers.append(("x-api-key", self._api_key) if is_anthropic_path(request.url.path)
                           else ("authorization", f"Bearer {self._api_key}"))
        if self._client is None:  # made on the server's event loop, closed with it
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0)))
        try:
            built = self._client.build_request(request.method, url, headers=headers,
                                               content=body)
        except httpx.InvalidURL as exc:
            raise APIError(400, f"this request's path cannot be forwarded ({exc}): "
                           "percent-encode it", code="invalid_url") from exc
        try:
            return await self._client.send(built, stream=True)
        except httpx.TimeoutException as exc:
            raise self._timed_out(exc) from exc
        except httpx.HTTPError as exc:
            raise APIError(502, f"cannot reach the upstream {self.url} ({exc}): is it running, "
                           "and does --upstream end with its API prefix (often /v1)?",
                           kind="api_error", code="upstream_unreachable") from exc

    async def _read(self, response: httpx.Response) -> bytes:
        """The whole body of a response that is not a stream; closed in any case."""
        try:
            return b"".join([chunk async for chunk in response.aiter_raw()])
        except httpx.HTTPError as exc:
            raise self._broken_off(exc) from exc
        finally:
            await response.aclose()

    def _broken_off(self, exc: httpx.HTTPError) -> APIError:
        """The error of an answer the upstream stopped sending: it stalled, or broke off."""
        if isinstance(exc, httpx.TimeoutException):
            return self._timed_out(exc)
        return APIError(502, f"the upstream {self.url} broke off its answer ({exc})",
                        kind="api_error", code="upstream_error")

    def _timed_out(self, exc: httpx.TimeoutException) -> APIError:
        return APIError(504, f"the upstream {self.url} sent nothing for {self.timeout:g} s "
                        f"({type(exc).__name__}): if it needs longer, raise the limit (kvtrace "
                        "serve --upstream-timeout)", kind="api_error", code="upstream_timeout")


class _StreamEnd:
    """Follows a relayed SSE stream, event by event, to see its last event arrive."""

    def __init__(self) -> None:
        self._pending = b""  # the start of an event not whole yet
        self.has_ended = False

    def feed(self, chunk: bytes) -> bool:
        """Take the next chunk; whether the stream's last event is now whole."""
        self._pending += chunk
        *blocks, self._pending = self._pending.replace(b"\r\n", b"\n").split(b"\n\n")
        names = [line[6:].strip() for block in blocks for line in block.split(b"\n")
                 if line.startswith(b"event:")]
        self.has_ended = (self.has_ended or any(name in _LAST_EVENTS for name in names)
                          or self._pending.rstrip().endswith(DONE)  # chat's, whole or not
                          or any(block.rstrip().endswith(DONE) for block in blocks))
        return self.has_ended

