"""The two client libraries the transports serve: httpx and httpx2, with one implementation.

The current SDKs (openai 3.x, anthropic 2.x) are built on httpx2, httpx's
successor under a new module name with the same transport interface:
`handle_request(request) -> response` (async: `handle_async_request`), a
request with `method`, `url`, `headers`, `content`, and a response whose
body is a byte stream. The openai SDK takes an `httpx.Client` or an
`httpx2.Client`; the anthropic SDK only an `httpx2.Client`, and refuses any
object whose class comes from the `httpx` package (client, transport or
timeout).

So one transport class serves both: it subclasses neither library (a client
calls its transport by that interface alone, and the anthropic SDK's check
passes), answers each request with the `Response` class of the request's
own library (`response_class`), sends it by default through that library's
`HTTPTransport` (`default_transport`), and wraps bodies in `SyncStream` /
`AsyncStream`, which subclass both libraries' byte-stream classes (each
client asserts that a body is its own kind). httpx2 is optional: without
it, everything is plain httpx.
"""

from __future__ import annotations

import importlib
from typing import Any

import httpx


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:  # no SDK that brings httpx2 is installed: httpx alone
        return None


httpx2: Any = _optional("httpx2")
_SyncStream2: type = httpx2.SyncByteStream if httpx2 is not None else object
_AsyncStream2: type = httpx2.AsyncByteStream if httpx2 is not None else object


class SyncStream(httpx.SyncByteStream, _SyncStream2):
    """A response body both an httpx and an httpx2 client accept (subclasses override both)."""


class AsyncStream(httpx.AsyncByteStream, _AsyncStream2):
    """The async twin of SyncStream."""


def is_httpx2(request: Any) -> bool:
    """Whether `request` comes from an httpx2 client."""
    return httpx2 is not None and isinstance(request, httpx2.Request)


def response_class(request: Any) -> Any:
    """The Response class of `request`'s library (httpx2's has the same interface)."""
    return httpx2.Response if is_httpx2(request) else httpx.Response


def default_transport(request: Any, *, is_async: bool) -> Any:
    """A new plain HTTP transport of `request`'s library (sync or async)."""
    library: Any = httpx2 if is_httpx2(request) else httpx
    return library.AsyncHTTPTransport() if is_async else library.HTTPTransport()
