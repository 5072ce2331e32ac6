"""The OpenAI chat-completions API as `kvtrace serve` checks it: the request and its paths.

`parse_chat_request` turns a request body into a `ChatRequest` or raises
`APIError` (request.py, with the body checks the three APIs share), which
the server sends as an OpenAI-style error body (``{"error": {"message",
"type", "param", "code"}}``) with a 4xx status. Everything is checked before
anything is recorded or forwarded, so bad input changes nothing. What is
accepted: `messages` (the function-calling format, apis/chat.py),
`model`, `tools`, `tool_choice`, `temperature` (0-2), `top_p` (0-1], `seed`,
`max_tokens`/`max_completion_tokens` (>= 1), `stop` (a string or up to 4),
`n` (1 only, in local mode), `stream`, `stream_options`; other fields are
passed on (upstream) or recorded as params (local), their values checked
only as the store would check them. `CHAT_PATH`, `MODELS_PATH` and
`TOKENIZE_PATH` are the chat endpoints the server itself knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtrace.apis import chat
from kvtrace.apis.chat import normalize_messages, normalize_tools
from kvtrace.errors import UsageError
from kvtrace.serve.request import (
    MAX_BODY_DEPTH,
    APIError,
    RequestFields,
    check_content_type,
    check_max_tokens,
    check_number,
    check_seed,
    check_tool_answers,
    check_type,
    is_int,
    parse_json,
)

# Programs and tests import these from here too (the shared ones live in request.py).
__all__ = ["CHAT_PATH", "MAX_BODY_DEPTH", "MODELS_PATH", "APIError", "ChatRequest",
           "check_content_type", "detokenize_request", "parse_chat_request", "tokenize_request"]

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
# vLLM's /tokenize for chat messages, at the server's root as vLLM and SGLang have it: the ids a
# prompt renders to, which engine benchmarks compare across servers. Local mode only.
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"  # vLLM's too: {"tokens": [...]} -> {"prompt": text}


@dataclass(frozen=True, slots=True)
class ChatRequest(RequestFields):
    """A checked chat-completions request; `body` is the JSON as sent."""

    MAX_TOKENS_FIELDS: ClassVar[tuple[str, ...]] = ("max_completion_tokens", "max_tokens")
    body: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None

    @property
    def includes_usage(self) -> bool:
        return chat.includes_usage(self.body)

    @property
    def stop(self) -> list[str]:
        stop = self.body.get("stop")
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else list(stop)


def model_list(model: str) -> dict[str, Any]:
    """`GET /v1/models` in local mode: the one model that answers, as OpenAI lists models."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                        "owned_by": "kvtrace"}]}


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
    if is_local:  # upstream mode: the upstream's own rule (lenient servers take them)
        check_tool_answers(messages)
    check_number(body, "temperature", 0.0, 2.0)
    check_number(body, "top_p", 0.0, 1.0, low_open=True)
    for name in ("max_tokens", "max_completion_tokens"):
        check_max_tokens(body, name)
    check_seed(body)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
        isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop)
    ):
        raise APIError(400, "'stop' must be a string or an array of up to 4 strings",
                       param="stop", code="invalid_value")
    check_type(body, "stream", bool, "a boolean")
    check_type(body, "stream_options", dict, "an object")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not (
        isinstance(choice, dict) and isinstance(choice.get("function"), dict)
    ):
        raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", param="tool_choice",
                       code="invalid_value")
    n = body.get("n")
    if n is not None and (not is_int(n) or n < 1 or (is_local and n != 1)):
        raise APIError(400, "'n' must be 1: kvtrace serve answers one choice per request",
                       param="n", code="invalid_value")
    return ChatRequest(body=body, messages=messages, tools=tools)


def tokenize_request(data: bytes, model: str) -> tuple[bool, bytes]:
    """A /tokenize body's `add_generation_prompt` (true when absent, as vLLM's), and the body
    less it, naming `model` where it names none (vLLM's /tokenize needs no model): the rest
    is a chat request's."""
    body = parse_json(data)
    if not isinstance(body, dict):
        return True, data
    value = body.get("add_generation_prompt", True)
    if not isinstance(value, bool):
        raise APIError(400, "add_generation_prompt must be true or false",
                       param="add_generation_prompt", code="invalid_value")
    rest = {"model": model} | {k: v for k, v in body.items() if k != "add_generation_prompt"}
    return value, json.dumps(rest, ensure_ascii=False).encode()


def detokenize_request(data: bytes) -> list[int]:
    """A /detokenize body's `tokens`: a list of ids."""
    body = parse_json(data)
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise APIError(400, "tokens: send a list of token ids", param="tokens",
                       code="invalid_value")
    return ids
