"""The OpenAI chat-completions API as `kvtrace serve` checks it: requests and errors.

`parse_chat_request` turns a request body into a `ChatRequest` or raises
`APIError`, which the server sends as an OpenAI-style error body
(``{"error": {"message", "type", "param", "code"}}``) with a 4xx status.
Everything is checked before anything is recorded or forwarded, so bad input
changes nothing. What is accepted: `messages` (the function-calling format,
store/messages.py), `model`, `tools`, `tool_choice`, `temperature` (0-2),
`top_p` (0-1], `seed`, `max_tokens`/`max_completion_tokens` (>= 1), `stop`
(a string or up to 4), `n` (1 only, in local mode), `stream`,
`stream_options`; other fields are passed on (upstream) or recorded as params
(local) unchecked. `CHAT_PATH` and `MODELS_PATH` are the two endpoints the
server itself knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.store.messages import normalize_messages, normalize_tools

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"


class APIError(Exception):
    """An error answered to the client: HTTP status and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A checked chat-completions request; `body` is the JSON as sent."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) else None

    @property
    def is_stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def includes_usage(self) -> bool:
        options = self.body.get("stream_options")
        return isinstance(options, dict) and bool(options.get("include_usage"))

    @property
    def max_tokens(self) -> int | None:
        value = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        return int(value) if value is not None else None

    @property
    def stop(self) -> list[str]:
        stop = self.body.get("stop")
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else list(stop)

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.body.get("tool_choice") != "none"


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what a 64-bit generator seed holds


def parse_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}); send a JSON "
                       "object with model and messages") from exc


def parse_chat_request(data: bytes, *, is_local: bool) -> ChatRequest:
    """Check a chat-completions request body (see the module docstring)."""
    body = parse_json(data)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object with model and messages")
    if "messages" not in body:
        raise APIError(400, "missing required parameter: 'messages'", param="messages",
                       code="missing_required_parameter")
    model = body.get("model")
    if is_local and not isinstance(model, str):
        raise APIError(400, "missing required parameter: 'model' (a string; GET /v1/models "
                       "lists the served model)", param="model",
                       code="missing_required_parameter")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model", code="invalid_type")
    if not isinstance(body["messages"], list) or not body["messages"]:
        raise APIError(400, "'messages' must be a non-empty array of chat messages",
                       param="messages", code="invalid_type")
    try:
        messages = normalize_messages(body["messages"])
        tools = normalize_tools(body.get("tools"))
    except UsageError as exc:
        param = "tools" if "tools" in str(exc).split(" ")[0] else "messages"
        raise APIError(400, str(exc), param=param, code="invalid_value") from exc
    _check_number(body, "temperature", 0.0, 2.0)
    _check_number(body, "top_p", 0.0, 1.0, low_open=True)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            raise APIError(400, f"'{name}' must be an integer >= 1", param=name,
                           code="invalid_value")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise APIError(400, "'seed' must be an integer", param="seed", code="invalid_type")
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise APIError(400, f"'seed' must be a 64-bit integer ({SEED_MIN} to {SEED_MAX})",
                       param="seed", code="invalid_value")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
        isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop)
    ):
        raise APIError(400, "'stop' must be a string or an array of up to 4 strings",
                       param="stop", code="invalid_value")
    for name in ("stream",):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise APIError(400, f"'{name}' must be a boolean", param=name, code="invalid_type")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options",
                       code="invalid_type")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not (
        isinstance(choice, dict) and isinstance(choice.get("function"), dict)
    ):
        raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", param="tool_choice",
                       code="invalid_value")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n < 1 or (is_local and n != 1)):
        raise APIError(400, "'n' must be 1: kvtrace serve answers one choice per request",
                       param="n", code="invalid_value")
    return ChatRequest(body=body, messages=messages, tools=tools)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(body: dict[str, Any], name: str, low: float, high: float, *,
                  low_open: bool = False) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"'{name}' must be a number", param=name, code="invalid_type")
    if value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise APIError(400, f"'{name}' must be in {bound}", param=name, code="invalid_value")
