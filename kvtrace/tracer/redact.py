"""Secrets never reach the store: header values and URL parts are redacted first.

Redacted by name (case-insensitive): the headers in `SECRET_HEADERS`
(Authorization, API keys, cookies) and any the caller adds; URL query
parameters whose name looks like a credential (`key`, `api_key`, `token`,
`secret`, `password`, `signature`, ...); a password in the URL's user info.
A redacted value is replaced by `REDACTED`, so a reader still sees that the
header was sent. Bodies are not searched: a secret an agent puts in a request
body is the agent's data (documented in docs/tracer.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "[redacted]"
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
