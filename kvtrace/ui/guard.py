"""Who may use the UI, and which POSTs are the person's own: the one place that decides.

Three checks, in this order, on every request:

- **Host.** The Host header must name an address the server was bound to
  (or, on loopback, `localhost`/`127.0.0.1`/`[::1]`). This stops DNS
  rebinding: a page on `evil.example` whose name is made to resolve to
  127.0.0.1 would otherwise be same-origin with the UI.
- **Key** (only with an `api_key`): an `Authorization: Bearer KEY` header
  or the `kvtrace_ui_key` cookie, set by the login form
  (HttpOnly, SameSite=Strict). Compared in constant time.
- **Cross-site POSTs.** A POST must carry the server's CSRF token (a random
  value made when the server starts, written into every form) in the
  `csrf` field; `Sec-Fetch-Site`, when the browser sends it, must be
  `same-origin` or `none`; `Origin`, when sent, must be the server's own.
  Any failure is a 403 and nothing changes.

Keys are checked for shape by `kvtrace.serve.app.check_api_key` (a bearer
token), as `kvtrace serve` does.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.requests import Request

from kvtrace.serve.app import check_api_key
from kvtrace.serve.runner import is_loopback

KEY_COOKIE = "kvtrace_ui_key"
CSRF_FIELD = "csrf"
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")


class Refused(Exception):
    """A request the guard turns away: `status` (401, 403, 421) and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Guard:
    """The checks of one UI server (module docstring)."""

    host: str = "127.0.0.1"
    api_key: str | None = None
    csrf_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    def __post_init__(self) -> None:
        self.api_key = check_api_key(self.api_key, "api_key")

    def check_request(self, request: Request) -> None:
        """Host, then key: raises Refused."""
        self.check_host(request)
        if self.api_key is not None and not self.is_authorized(request):
            raise Refused(401, "this kvtrace ui needs its key: log in with the --api-key it "
                          "was started with")

    def is_authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.cookies.get(KEY_COOKIE)
        return given is not None and self.is_key(given)

    def is_key(self, given: str) -> bool:
        return self.api_key is not None and hmac.compare_digest(given.encode(),
                                                                self.api_key.encode())

    def check_post(self, request: Request, form: dict[str, str]) -> None:
        """A POST that a page of this server sent, or Refused(403)."""
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            raise Refused(403, f"refused a cross-site request (Sec-Fetch-Site: {site})")
        origin = request.headers.get("origin")
        if origin is not None and origin != self._own_origin(request):
            raise Refused(403, "refused a request from another origin")
        token = form.get(CSRF_FIELD, "")
        if not hmac.compare_digest(token.encode(), self.csrf_token.encode()):
            raise Refused(403, "refused a form without this server's token: reload the page "
                          "and send the form again")

    def check_host(self, request: Request) -> None:
        name = _host_name(request.headers.get("host", ""))
        allowed = {self.host.lower(), f"[{self.host.lower()}]"}
        if is_loopback(self.host):
            allowed.update(_LOOPBACK_NAMES)
        if self.host in ("0.0.0.0", "::"):  # every address of the machine: cannot list them
            return
        if name not in allowed:
            raise Refused(421, f"this kvtrace ui answers for {self.host}, not for the host "
                          "the request names")

    def _own_origin(self, request: Request) -> str:
        return f"{request.url.scheme}://{request.headers.get('host', '')}"


def _host_name(host: str) -> str:
    """The Host header without its port, lower case (`[::1]:8080` -> `[::1]`)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return urlsplit(f"//{host}").hostname or host
