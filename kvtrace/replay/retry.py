"""When a request to a remote backend is worth another try, and how long to wait first.

A replay request changes nothing on the server but its prefix cache, so
sending it again is always safe; what matters is whether the failure can go
away by itself. These can: the server could not be reached or dropped the
connection before answering (`httpx.NetworkError`, `ConnectTimeout`,
`RemoteProtocolError`: a server restarting, a keep-alive connection it had
just closed), it is overloaded (HTTP 429), or it failed on its side (HTTP 5xx,
except 501 and 505, which say the request will never work). A read timeout
is not retried: the request ran for `timeout_s` already. Anything else (4xx:
a bad request, a wrong model name, a missing key) fails at once.

Waits grow exponentially with jitter (`base_delay_s * 2**k`, times a random
factor in [0.5, 1], at most `max_delay_s`), so that many runs that failed
together do not come back together. A server that says how long to wait
(`Retry-After`, in seconds or as an HTTP date) is honoured exactly, never
retried sooner; if it asks for more than `max_delay_s`, the request fails at
once, saying so, instead of waiting longer than the caller allowed.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING

from kvtrace.errors import UsageError

if TYPE_CHECKING:  # httpx is loaded by the remote backend, not by importing kvtrace.replay
    import httpx

_FINAL_5XX = frozenset({501, 505})  # not implemented, version not supported: never transient


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently a failed request is sent again (module docstring).

    `max_attempts` counts the first try: 1 means no retry.
    """

    max_attempts: int = 5
    base_delay_s: float = 0.5
    max_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise UsageError(f"retry needs max_attempts >= 1, not {self.max_attempts}",
                             param="retries")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise UsageError("retry needs 0 <= base_delay_s <= max_delay_s")

    def backoff_s(self, num_failed: int, rng: random.Random) -> float:
        """The wait after the `num_failed`-th failed attempt, when the server named none."""
        return min(self.max_delay_s, self.base_delay_s * 2 ** (num_failed - 1)) * rng.uniform(
            0.5, 1.0)


NO_RETRY = RetryPolicy(max_attempts=1)


def is_retried_status(status: int) -> bool:
    """Whether an HTTP status may go away by itself: 429 and 5xx (not 501, 505)."""
    return status == 429 or (500 <= status < 600 and status not in _FINAL_5XX)


def retry_after_s(value: str | None, *, now: float | None = None) -> float | None:
    """A `Retry-After` header in seconds from `now` (None: absent or unreadable).

    Either delta-seconds (`120`) or an HTTP date (`Wed, 21 Oct 2026 07:28:00 GMT`);
    a date in the past means now (0).
    """
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # an HTTP date is GMT; a malformed one may lack the zone
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return max(0.0, seconds)


class Attempts:
    """One request sent under a policy (create one per request: it keeps that request's tally).

    `send(attempt)` calls `attempt()` until it gives a response that is not
    retried, or attempts run out: then the last response is returned, or the
    last transport error propagates. Afterwards `retried` holds one reason
    per retried attempt ("HTTP 503", "ConnectError"), and `refused_wait_s`
    the wait a server asked for when it was longer than the policy allows
    (that response is returned at once).
    """

    def __init__(self, policy: RetryPolicy, *, sleep: Callable[[float], None] = time.sleep,
                 rng: random.Random | None = None) -> None:
        self.policy = policy
        self.retried: list[str] = []
        self.refused_wait_s: float | None = None
        self.last_attempt_s = 0.0  # how long the last attempt took (waits excluded)
        self._sleep = sleep
        self._rng = rng or random.Random()

    @property
    def num_attempts(self) -> int:
        """Attempts made so far (after `send`: all of them)."""
        return len(self.retried) + 1

    def send(self, attempt: Callable[[], httpx.Response]) -> httpx.Response:
        import httpx

        retried_errors = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
        policy = self.policy
        while True:
            is_last = self.num_attempts >= policy.max_attempts
            started = time.perf_counter()
            try:
                response = attempt()
            except retried_errors as exc:
                if is_last:
                    raise
                self._wait(type(exc).__name__, None)
                continue
            self.last_attempt_s = time.perf_counter() - started
            if is_last or not is_retried_status(response.status_code):
                return response
            asked = retry_after_s(response.headers.get("retry-after"))
            if asked is not None and asked > policy.max_delay_s:
                self.refused_wait_s = asked
                return response
            self._wait(f"HTTP {response.status_code}", asked)

    def _wait(self, reason: str, asked_s: float | None) -> None:
        self.retried.append(reason)
        self._sleep(asked_s if asked_s is not None
                    else self.policy.backoff_s(len(self.retried), self._rng))


def tally(reasons: Iterable[str]) -> str:
    """Reasons counted, most frequent first: "HTTP 503 x2, ConnectError x1"."""
    return ", ".join(f"{reason} x{n}" for reason, n in Counter(reasons).most_common())
