"""The Anthropic Messages API as `kvtrace serve` speaks it: requests, answers, streams, errors.

`parse_messages_request` checks a `POST /v1/messages` body before any work
(the shared body checks of request.py, then the API's own fields) and raises
request.py's `APIError`, which app.py sends in Anthropic's error shape
(`error_body`: ``{"type": "error", "error": {"type", "message"}}``, the
type named from the status). Required: `model`, `max_tokens` (>= 1) and
`messages`, whose blocks are checked by the store's own normaliser
(apis/anthropic.py: a block needs its fields, a `tool_result` must answer
an earlier `tool_use`); `system`, `tools`, `tool_choice` (`auto`, `any`,
`tool` with a name, `none`), `temperature` [0, 1], `top_p` (0, 1], `top_k`,
`stop_sequences`, `stream`, `metadata` are checked; other fields are
passed on (upstream) or recorded as params (local). `POST
/v1/messages/count_tokens` takes the same body without `max_tokens`; local
mode answers it with the rendered prompt's length (`{"input_tokens": N}`,
nothing generated or recorded).

In local mode the request is rendered as its chat view (apis/__init__.py,
the form the recorded step is read back in), and `MessagesReply` answers
with a Messages `message`: a `text` block, then one `tool_use` block per
tool call parsed from the output (ids `toolu_…`, `input` the arguments
object, empty arguments an empty one; when a call's arguments spell no JSON
object the whole output is answered as text, since `input` must be one), `stop_reason` (`tool_use`,
`stop_sequence`, `max_tokens` or `end_turn`), and `usage` in Anthropic's
terms: `input_tokens` excludes cache reads, `cache_read_input_tokens` is
the prefix the KV cache served, `cache_creation_input_tokens` is 0 (the
cache writes are not billed: no counterpart). Streamed, it is the API's
events: `message_start`, `content_block_start` / `content_block_delta`
(`text_delta`, `input_json_delta`) / `content_block_stop` per block,
`message_delta` (stop reason, final usage), `message_stop`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvtrace.apis import ProviderApi, anthropic, chat_view, native_request
from kvtrace.apis.sse import encode_event
from kvtrace.serve.generation import Generation, native_step, stored_call
from kvtrace.serve.request import (
    APIError,
    RequestFields,
    check_max_tokens,
    check_number,
    check_seed,
    check_type,
    is_int,
    normalised,
    parse_json,
    require,
)
from kvtrace.tracer.endpoints import ANTHROPIC

if TYPE_CHECKING:
    from kvtrace.serve.recording import StepWrite

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"  # Claude Code asks it; local mode answers
TOOL_CHOICES = ("auto", "any", "tool", "none")
# Anthropic's error types, by the HTTP status they come with.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}


def error_body(error: APIError) -> dict[str, Any]:
    """`error` in Anthropic's shape (its type named from the status; 5xx: `api_error`)."""
    kind = _ERROR_TYPES.get(error.status)
    if kind is None:
        kind = "api_error" if error.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_event(error: APIError) -> bytes:
    """`error` as the SSE event that ends a Messages stream (the SDK raises it)."""
    return encode_event(error_body(error))


def stream_error_event(path: str, error: APIError) -> bytes:
    """The SSE event that ends a stream of the API of `path` with `error` (the SDKs raise
    it): Anthropic's `error` event, else a data line holding an OpenAI error body."""
    if is_anthropic_path(path):
        return error_event(error)
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"


@dataclass(frozen=True, slots=True)
class MessagesRequest(RequestFields):
    """A checked Messages request: `body` as sent, its stored form, and its chat view."""

    MAX_TOKENS_FIELDS: ClassVar[tuple[str, ...]] = ("max_tokens",)
    body: dict[str, Any]
    native_messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None
    native_tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]]  # the chat view, what the engine renders
    tools: list[dict[str, Any]] | None

    @property
    def stop(self) -> list[str]:
        return list(self.body.get("stop_sequences") or [])

    @property
    def parses_tool_calls(self) -> bool:
        choice = self.body.get("tool_choice")
        return bool(self.tools) and not (isinstance(choice, dict)
                                         and choice.get("type") == "none")


def is_anthropic_path(path: str) -> bool:
    """Whether `path` belongs to the Messages API (its errors are in Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def parse_messages_request(data: bytes, *, is_counted_only: bool = False) -> MessagesRequest:
    """Check a Messages request body (see the module docstring); `is_counted_only`: a
    `count_tokens` request, which has no `max_tokens`."""
    body = parse_json(data)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object with model, max_tokens "
                       "and messages")
    model = require(body, "model", "a string")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' must be a non-empty string", param="model",
                       code="invalid_type")
    if not is_counted_only:
        require(body, "max_tokens", "an integer >= 1: the most tokens to generate")
    check_max_tokens(body, "max_tokens")
    if not isinstance(require(body, "messages", "a list of messages"), list) or not (
            body["messages"]):
        raise APIError(400, "'messages' must be a non-empty array of messages",
                       param="messages", code="invalid_type")
    messages = normalised(anthropic.normalize_messages, body["messages"], "messages")
    system = normalised(anthropic.normalize_system, body.get("system"), "system")
    tools = normalised(anthropic.normalize_tools, body.get("tools"), "tools")
    for index, tool in enumerate(tools or []):
        if "input_schema" in tool and not isinstance(tool["input_schema"], dict):
            raise APIError(400, f"tools[{index}].input_schema must be a JSON schema object",
                           param="tools", code="invalid_value")
    _check_tool_choice(body.get("tool_choice"))
    check_number(body, "temperature", 0.0, 1.0)
    check_number(body, "top_p", 0.0, 1.0, low_open=True)
    top_k = body.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise APIError(400, "'top_k' must be an integer >= 0", param="top_k",
                       code="invalid_value")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list)
                                  and all(isinstance(s, str) for s in stops)):
        raise APIError(400, "'stop_sequences' must be an array of strings",
                       param="stop_sequences", code="invalid_value")
    check_type(body, "stream", bool, "a boolean")
    check_type(body, "metadata", dict, "an object")
    check_seed(body)
    stored = normalised(lambda _: stored_call(ProviderApi.ANTHROPIC_MESSAGES, messages,
                                              system, tools), None, "messages")
    view = chat_view(ProviderApi.ANTHROPIC_MESSAGES, stored)
    native = native_request(ProviderApi.ANTHROPIC_MESSAGES, stored)
    return MessagesRequest(body=body, native_messages=stored["messages"],
                           system=native.get("system"), native_tools=native.get("tools"),
                           messages=view.messages, tools=view.tools)


def _check_tool_choice(choice: Any) -> None:
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in TOOL_CHOICES or (
            choice["type"] == "tool" and not isinstance(choice.get("name"), str)):
        raise APIError(400, "'tool_choice' must be {'type': 'auto'}, {'type': 'any'}, "
                       "{'type': 'none'} or {'type': 'tool', 'name': ...}",
                       param="tool_choice", code="invalid_value")


def content_blocks(generation: Generation) -> list[dict[str, Any]]:
    """The output as Messages content blocks (see the module docstring)."""
    calls = generation.tool_calls
    if any(anthropic.tool_input(call["function"]["arguments"]) is None for call in calls):
        return anthropic.blocks_of({"role": "assistant", "content": generation.text})
    return anthropic.blocks_of({
        "role": "assistant", "content": generation.message.get("content") or "",
        "tool_calls": [{**call, "id": "toolu_" + call["id"].removeprefix("call_")}
                       for call in calls]})


class MessagesReply:
    """The local engine's answer to a Messages request (see the module docstring)."""

    def __init__(self, request: MessagesRequest, generation: Generation, *, model: str) -> None:
        self.request = request
        self.generation = generation
        self.model = model
        blocks = content_blocks(generation)
        if any(block["type"] == "tool_use" for block in blocks):
            stop_reason = "tool_use"
        elif generation.stop_sequence is not None:
            stop_reason = "stop_sequence"
        else:
            stop_reason = "max_tokens" if generation.finish_reason == "length" else "end_turn"
        self.usage = {
            "input_tokens": generation.prompt_tokens - generation.reused_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": generation.reused_tokens,
            "output_tokens": generation.completion_tokens,
        }
        self.body: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": model, "content": blocks, "stop_reason": stop_reason,
            "stop_sequence": generation.stop_sequence, "usage": self.usage,
        }

    def events(self) -> Iterator[bytes]:
        return (encode_event(event) for event in anthropic.stream_events(self.body))

    def step(self, url: str, *, is_complete: bool = True) -> StepWrite:
        request = self.request
        return native_step(self, url, is_complete=is_complete, endpoint=ANTHROPIC,
                           conversation=request.native_messages, system=request.system,
                           tools=request.native_tools, finish_reason=anthropic.finish_reason)
