"""A request as every API of `kvtrace serve` checks it: the body, the fields, the error.

The server speaks three APIs (chat completions, api.py; Anthropic Messages,
anthropic_api.py; OpenAI Responses, responses_api.py). Each checks its own
fields, but the rules below are one for all, written once so that the three
cannot drift apart: an `APIError` is what a client is answered (app.py sends
it in the shape of the API whose path was called), and everything is checked
before anything is recorded or forwarded, so bad input changes nothing.

The body must be sent as `application/json` (else 415) and be JSON the
store can keep, whatever field a value is in: no NaN or infinity (Python's
parser takes them, the store's canonical encoding does not), no nesting
past `MAX_BODY_DEPTH` (the store keeps `MAX_DEPTH` levels, and a step puts
a request's values a few levels down), no text that is not Unicode (a lone
surrogate, which no tokenizer or database takes), no integer wider than the
store's `MAX_INT_BITS`. The walk is iterative, so no body, however deep,
reaches a recursive function.

`RequestFields` reads the fields the three APIs name alike (`model`,
`stream`, the token limit, `tool_choice: "none"`) from the body as sent,
for each API's checked request.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from kvtrace.errors import UsageError
from kvtrace.store.objects.encoding import MAX_DEPTH, MAX_INT_BITS

JSON_MEDIA_TYPE = "application/json"
# A step stores a request's values a few containers down (meta.params.NAME,
# content.messages): the body keeps that much below the store's own limit.
MAX_BODY_DEPTH = MAX_DEPTH - 8
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what a 64-bit generator seed holds
# Content parts the local engine cannot read, in the three APIs' words (chat's `image_url`
# and `input_audio`, Anthropic's `image` and `document`, Responses' `input_image` and
# `input_file`): a 400 in local mode, never dropped in silence (check_text_only).
UNREAD_PARTS = frozenset({"image_url", "input_audio", "file", "image", "document",
                          "input_image", "input_file"})
_log = logging.getLogger("uvicorn.error")  # where uvicorn logs its own errors


class APIError(Exception):
    """An error answered to the client: HTTP status and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class RequestFields:
    """The fields the three APIs name alike, read from a checked request's `body`.

    A base of each API's frozen request record (no slots of its own, so theirs
    stay slotted). `MAX_TOKENS_FIELDS` names the API's token limit, the first
    present wins; Anthropic says "no tools" in its own words and overrides
    `parses_tool_calls`.
    """

    __slots__ = ()
    MAX_TOKENS_FIELDS: ClassVar[tuple[str, ...]] = ()
    body: dict[str, Any]
    tools: list[dict[str, Any]] | None

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) else None

    @property
    def is_stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def max_tokens(self) -> int | None:
        name = next((name for name in self.MAX_TOKENS_FIELDS if name in self.body), None)
        value = self.body.get(name) if name is not None else None
        return int(value) if value is not None else None

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.body.get("tool_choice") != "none"


def failed_answer(method: str, path: str, exc: Exception) -> APIError:
    """The 500 to answer when answering failed for no fault of the request (the store's
    database gone, a bug), logged here once with its traceback."""
    _log.error("kvtrace serve: %s %s failed", method, path, exc_info=exc)
    return APIError(500, f"kvtrace serve failed to answer ({type(exc).__name__}: {exc}); the "
                    "server's log has the details", kind="server_error", code="internal_error")


def check_content_type(content_type: str | None) -> None:
    """A request is JSON, declared so (a charset parameter is fine); else 415."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        what = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise APIError(415, f"the request was sent with {what}: send the body as JSON, with "
                       f"'Content-Type: {JSON_MEDIA_TYPE}'", code="unsupported_media_type")


def parse_json(data: bytes) -> Any:
    """The JSON value of a request body, checked as the store would check it (module docstring)."""
    try:
        value = json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise APIError(400, f"the request body is nested more than {MAX_BODY_DEPTH} levels "
                       "deep", code="invalid_value") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}); send one JSON "
                       "object") from exc
    check_storable(value)
    return value


def check_storable(body: Any) -> None:
    """Refuse, as a 400 naming where, a value of `body` the store could not record."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(body, 0, ())]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _is_unicode(value):
                raise APIError(400, f"{_path(where)} is not valid Unicode (it holds a lone "
                               "surrogate, such as \\ud800): send UTF-8 text",
                               code="invalid_value")
        elif isinstance(value, int) and not isinstance(value, bool):
            if value.bit_length() > MAX_INT_BITS:
                raise APIError(400, f"{_path(where)} is an integer of {value.bit_length()} "
                               f"bits: at most {MAX_INT_BITS} bits can be recorded",
                               code="invalid_value")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_BODY_DEPTH:
                raise APIError(400, f"{_path(where)} is nested more than {MAX_BODY_DEPTH} "
                               "levels deep", code="invalid_value")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and not key.isascii() and not _is_unicode(key):
                    raise APIError(400, f"a key in {_path(where)} is not valid Unicode (a lone "
                                   "surrogate): send UTF-8 text", code="invalid_value")
                stack.append((item, depth + 1, (where, key)))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(where: tuple[Any, ...]) -> str:
    """`where` (nested (parent, key) pairs) as "body.messages[0].content"."""
    keys: list[Any] = []
    while where:
        where, key = where
        keys.append(key)
    return "body" + "".join(f"[{key}]" if isinstance(key, int) else f".{key}"
                            for key in reversed(keys))


def _refuse_constant(name: str) -> Any:
    raise APIError(400, f"the request body holds {name}, which is not a JSON number: send "
                   "finite numbers only", code="invalid_value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(400, f"the number {text[:40]} is past the range of a double: send "
                       "finite numbers only", code="invalid_value")
    return value


def normalised(normalise: Callable[[Any], Any], value: Any, param: str) -> Any:
    """`normalise(value)` (a store normaliser), its UsageError a 400 naming `param`."""
    try:
        return normalise(value)
    except UsageError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from exc


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require(body: dict[str, Any], name: str, what: str) -> Any:
    """`body[name]`, or a 400 naming the missing field (`what` describes it)."""
    if name not in body:
        raise APIError(400, f"missing required parameter: '{name}' ({what})", param=name,
                       code="missing_required_parameter")
    return body[name]


def check_type(body: dict[str, Any], name: str, kind: type | tuple[type, ...],
               what: str) -> None:
    """A 400 when `body[name]` is present, not null and not of `kind` (`what` names it;
    not for numbers: a bool is an int to isinstance)."""
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise APIError(400, f"'{name}' must be {what}", param=name, code="invalid_type")


def check_max_tokens(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and (not is_int(value) or value < 1):
        raise APIError(400, f"'{name}' must be an integer >= 1", param=name,
                       code="invalid_value")


def check_seed(body: dict[str, Any]) -> None:
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise APIError(400, "'seed' must be an integer", param="seed", code="invalid_type")
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise APIError(400, f"'seed' must be a 64-bit integer ({SEED_MIN} to {SEED_MAX})",
                       param="seed", code="invalid_value")


def check_number(body: dict[str, Any], name: str, low: float, high: float, *,
                 low_open: bool = False) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"'{name}' must be a number", param=name, code="invalid_type")
    if value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise APIError(400, f"'{name}' must be in {bound}", param=name, code="invalid_value")


def check_text_only(messages: list[dict[str, Any]]) -> None:
    """A 400 where a message holds a part the local model cannot read (`UNREAD_PARTS`):
    answering as if it were not there would be a wrong answer, recorded as a right one.
    `messages` in chat shape, as each API's request gives them."""
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in UNREAD_PARTS:
                raise APIError(400, f"a {message.get('role')} message holds a {kind!r} part: "
                               "the local model reads text only (send text, or serve with "
                               "--upstream, which passes it on)", param="messages",
                               code="unsupported_content")


def check_tool_answers(messages: list[dict[str, Any]]) -> None:
    """Every `tool` message answers a tool call of an earlier assistant turn, as the chat,
    Anthropic and Responses APIs all require (the other two check it as they normalise);
    `messages` in chat shape."""
    asked: set[Any] = set()
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            calls = message.get("tool_calls") or []
            asked.update(c.get("id") for c in calls if isinstance(c, Mapping))
        elif message.get("role") == "tool" and message.get("tool_call_id") not in asked:
            raise APIError(400, f"messages[{index}]: a tool message answers "
                           f"{message.get('tool_call_id')!r}, no tool call of an earlier "
                           "assistant turn", param="messages", code="invalid_value")
