"""One HTTP exchange as the bytes that crossed the wire, and what its chat-completions
body says.

Both the httpx transports and `kvtrace serve` capture an `Exchange` (the
request and response as bytes, secrets still in) and hand it to
`capture.record_exchange`, the one place that decides what is stored. This
module only reads: the body content-decoded, whether it is a chat
completions call, its request and its completion (a stream assembled).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from kvtrace.apis import chat
from kvtrace.store.usage import Usage

if TYPE_CHECKING:
    pass



@dataclass(frozen=True, slots=True)
class Exchange:
    """A request and its response, as bytes (bodies content-decoded), secrets not yet removed."""

    method: str
    url: str
    request_headers: tuple[tuple[str, str], ...]
    request_body: bytes
    status: int
    response_headers: tuple[tuple[str, str], ...]
    response_body: bytes
    is_complete: bool = True  # False: the client closed a stream before its end
    total_s: float | None = None
    first_byte_s: float | None = None

    @property
    def is_stream(self) -> bool:
        return (content_type(self.response_headers) or "").startswith("text/event-stream")


def decoded_body(headers: httpx.Headers, raw: bytes) -> bytes:
    """A body without its content-encoding (gzip, br, ...), as httpx decodes it."""
    if not headers.get("content-encoding"):
        return raw
    try:
        return httpx.Response(200, headers={"content-encoding": headers["content-encoding"]},
                              content=raw).content
    except httpx.DecodingError:
        return raw


def is_chat_completions(method: str, url: str) -> bool:
    """Whether a request goes to an OpenAI-style chat-completions endpoint."""
    return method.upper() == "POST" and urlsplit(url).path.rstrip("/").endswith(
        "/chat/completions"
    )


def chat_request(body: bytes) -> dict[str, Any] | None:
    """The JSON body of a chat-completions request, or None when it is not one."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        return None
    return data


def chat_completion(exchange: Exchange) -> dict[str, Any] | None:
    """The completion an exchange answered (assembled from SSE), or None when it is not one."""
    if not 200 <= exchange.status < 300:
        return None
    try:
        if exchange.is_stream:
            completion = chat.assemble(exchange.response_body)
        else:
            completion = json.loads(exchange.response_body)
    except (ValueError, UnicodeDecodeError, TypeError, AttributeError):
        return None
    if not isinstance(completion, dict) or not isinstance(completion.get("choices"), list):
        return None
    if not completion["choices"] or not isinstance(completion["choices"][0], dict):
        return None
    return completion


def usage_of(completion: Mapping[str, Any]) -> dict[str, Any]:
    """The completion's usage with `cached_tokens` lifted out (only when reported)."""
    usage = dict(completion.get("usage") or {})
    cached = Usage.parse(usage).cached_tokens
    if cached is not None and "cached_tokens" not in usage:
        usage["cached_tokens"] = cached
    finish = completion["choices"][0].get("finish_reason")
    if finish is not None:
        usage["finish_reason"] = finish
    return usage


def content_type(headers: tuple[tuple[str, str], ...]) -> str | None:
    """The `content-type` of captured headers, None when there is none."""
    return next((v for k, v in headers if k.lower() == "content-type"), None)
