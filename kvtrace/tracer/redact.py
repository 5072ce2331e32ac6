"""Secrets never reach the store: headers, URL parts and credential fields are redacted first.

Redacted by name (case-insensitive): the headers in `SECRET_HEADERS`
(Authorization, API keys, cookies) and any the caller adds; URL query
parameters (and form-encoded body fields) whose name looks like a
credential (`key`, `api_key`, `token`, `secret`, `password`, `signature`,
...); a password in the URL's user info; in JSON, at any depth, the string
and number values of fields named as credentials (`api_key`, `password`,
`client_secret`, `access_token`, `token`, `credentials`, ...: `is_secret_field`)
— in a model call's params (`metadata.password`, an `api_key` sent in the
body) and in an http step's JSON bodies, request and response. A redacted
value is replaced by `REDACTED`, so a reader still sees that it was sent.

Not searched: a model call's `messages` and `tools`, the prompt itself. It
is stored exactly as sent (replay needs the very tokens the model saw): a
secret an agent writes into a prompt or a tool result is part of the trace
(docs/tracer.md). Redaction is idempotent, and `ReplayTransport` applies it
to both sides before matching, so a redacted recording still answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "[redacted]"
MAX_DEPTH = 256  # JSON nested deeper is cut there (the store refuses it in any field)
SECRET_HEADERS = frozenset({
    "authorization",
    "proxy-authorization",
    "api-key",
    "x-api-key",
    "x-goog-api-key",
    "cookie",
    "set-cookie",
})
_SECRET_PARAM = re.compile(
    r"(^|[_-])(key|apikey|api[_-]?key|token|access[_-]?token|secret|password|passwd|"
    r"signature|sig|auth|credential|session)($|[_-])",
    re.IGNORECASE,
)
# Whole field names (any case, "-" or "_"): narrower than the URL rule, since JSON bodies hold
# `max_tokens`, `prompt_cache_key`, `eos_token` and the like, which are no secrets.
_SECRET_FIELD = re.compile(
    r"(?:[a-z0-9]+[_-])*(?:api[_-]?key|secret|secret[_-]?key|private[_-]?key|password|passwd|"
    r"access[_-]?token|refresh[_-]?token|id[_-]?token|auth[_-]?token|session[_-]?token|"
    r"credentials?)|token|authorization|cookie|bearer",
    re.IGNORECASE,
)


def is_secret_field(name: str) -> bool:
    """Whether a JSON field of this name holds a credential (`api_key`, `metadata.password`)."""
    return _SECRET_FIELD.fullmatch(name) is not None


class Redactor:
    """Redacts the built-in secret headers plus `extra_headers` (names, any case)."""

    def __init__(self, extra_headers: Iterable[str] = ()) -> None:
        self.secret_headers = SECRET_HEADERS | {name.lower() for name in extra_headers}

    def is_secret(self, header: str) -> bool:
        return header.lower() in self.secret_headers

    def headers(self, headers: Iterable[tuple[str, str]]) -> dict[str, str]:
        """Headers as a dict (lower-case names; repeated ones joined by ", "), secrets redacted."""
        out: dict[str, str] = {}
        for name, value in headers:
            key = name.lower()
            value = REDACTED if key in self.secret_headers else value
            out[key] = f"{out[key]}, {value}" if key in out else value
        return out

    def fields(self, value: Any) -> Any:
        """A JSON value with the string and number values of secret fields redacted, at any depth.

        Containers under a secret name are searched, not replaced: a tool
        schema's `"password": {"type": "string"}` is no secret.
        """
        return _redact_fields(value, MAX_DEPTH)

    def body(self, body: bytes, content_type: str | None) -> bytes:
        """A JSON or form-encoded body with secret fields redacted; other bodies as they are.

        The bytes are kept exactly when nothing is secret (a JSON body is
        re-encoded only when a value was redacted).
        """
        kind = (content_type or "").split(";")[0].strip().lower()
        if kind == "application/x-www-form-urlencoded":
            try:
                pairs = parse_qsl(body.decode(), keep_blank_values=True)
            except UnicodeDecodeError:
                return body
            if not any(_SECRET_PARAM.search(k) for k, _ in pairs):
                return body
            return urlencode([(k, REDACTED if _SECRET_PARAM.search(k) else v) for k, v in pairs],
                             safe="[]").encode()
        if "json" not in kind and body.lstrip()[:1] not in (b"{", b"["):
            return body
        try:
            data = json.loads(body)
            redacted = self.fields(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return body
        if redacted == data:
            return body
        return json.dumps(redacted, ensure_ascii=False, separators=(",", ":")).encode()

    def url(self, url: str) -> str:
        """The URL with credential-like query values and a user-info password redacted."""
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:{REDACTED}@{host}" if ":" in userinfo else f"{REDACTED}@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode(
                [(k, REDACTED if _SECRET_PARAM.search(k) else v) for k, v in pairs], safe="[]"
            )
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redact_fields(value: Any, depth: int) -> Any:
    if depth == 0:
        return REDACTED  # deeper than any store accepts: nothing below is kept as sent
    if isinstance(value, dict):
        return {
            key: REDACTED if is_secret_field(str(key)) and _is_scalar(item)
            else _redact_fields(item, depth - 1)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_redact_fields(item, depth - 1) for item in value]
    return value


def _is_scalar(value: Any) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)
