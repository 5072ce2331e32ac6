"""The OpenAI Responses API as `kvtrace serve` speaks it: requests, answers, streams.

`parse_responses_request` checks a `POST /v1/responses` body before any
work (the shared body checks of request.py, then the API's own fields) and
raises request.py's `APIError`, sent in OpenAI's error shape. `input` (a string
or a list of items) is checked by the store's own normaliser
(apis/responses.py: an item needs its fields, a `function_call_output`
must answer an earlier `function_call`); `model`, `instructions`, `tools`,
`tool_choice`, `temperature` [0, 2], `top_p` (0, 1], `max_output_tokens`
(>= 1), `stream`, `parallel_tool_calls`, `store`, `metadata` are checked;
other fields are passed on (upstream) or recorded as params (local). A
request that continues a stored response (`previous_response_id`,
`conversation`) has its calls there: its outputs are not matched to calls
here (upstream mode); local mode keeps no responses, so it refuses them and
hosted prompts (`prompt`) and `background` runs, with a 400 that says to
send the whole conversation as `input`.

In local mode the request is rendered as its chat view (apis/__init__.py),
and `ResponsesReply` answers with a `response` object: a `message` item
with the text (`output_text`), then one `function_call` item per tool call
parsed from the output; `status` `completed`, or `incomplete` (reason
`max_output_tokens`) when the token limit cut a text answer; `usage` in
OpenAI's terms: `input_tokens` includes the cached ones,
`input_tokens_details.cached_tokens` is the prefix the KV cache served.
Streamed, it is the API's events, each with its `sequence_number`:
`response.created`, `response.in_progress`, per item
`response.output_item.added`, its content (`response.content_part.added`,
`response.output_text.delta` / `.done`, `response.content_part.done`; or
`response.function_call_arguments.delta` / `.done`) and
`response.output_item.done`, then `response.completed` (or
`response.incomplete`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvtrace.apis import ProviderApi, chat_view, native_request, responses
from kvtrace.apis.sse import encode_event
from kvtrace.serve.generation import Generation, native_step, stored_call
from kvtrace.serve.request import (
    APIError,
    RequestFields,
    check_max_tokens,
    check_number,
    check_seed,
    check_type,
    normalised,
    parse_json,
    require,
)
from kvtrace.tracer.endpoints import RESPONSES

if TYPE_CHECKING:
    from kvtrace.serve.recording import StepWrite

RESPONSES_PATH = "/v1/responses"
TOOL_CHOICES = ("none", "auto", "required")
_CONTINUES = ("previous_response_id", "conversation")
_NOT_LOCAL = (*_CONTINUES, "prompt")


@dataclass(frozen=True, slots=True)
class ResponsesRequest(RequestFields):
    """A checked Responses request: `body` as sent, its stored form, and its chat view."""

    MAX_TOKENS_FIELDS: ClassVar[tuple[str, ...]] = ("max_output_tokens",)
    body: dict[str, Any]
    native_input: list[dict[str, Any]]
    instructions: str | None
    native_tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]]  # the chat view, what the engine renders
    tools: list[dict[str, Any]] | None

    @property
    def stop(self) -> list[str]:
        return []


def parse_responses_request(data: bytes, *, is_local: bool) -> ResponsesRequest:
    """Check a Responses request body (see the module docstring)."""
    body = parse_json(data)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object with model and input")
    if is_local:
        require(body, "model", "a string")
        for name in _NOT_LOCAL:
            if body.get(name) is not None:
                raise APIError(400, f"'{name}' needs responses stored by the provider, and "
                               "kvtrace serve's local mode stores none: send the whole "
                               "conversation as 'input' (with 'store': false)", param=name,
                               code="unsupported_parameter")
        if body.get("background"):
            raise APIError(400, "'background' responses are not run in local mode: send "
                           "the request without it", param="background",
                           code="unsupported_parameter")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise APIError(400, "'model' must be a non-empty string", param="model",
                       code="invalid_type")
    continues = any(body.get(name) is not None for name in _CONTINUES)
    if is_local or "input" in body or not continues:
        given = require(body, "input", "a string or a list of input items")
        if not isinstance(given, (str, list)) or not given:
            raise APIError(400, "'input' must be a non-empty string or array of input items",
                           param="input", code="invalid_type")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "'instructions' must be a string", param="instructions",
                       code="invalid_type")
    prior = _unstored_calls(body.get("input"), continues=continues)
    items = normalised(lambda value: responses.normalize_input(value, prior),
                       body.get("input") or [], "input")
    tools = normalised(responses.normalize_tools, body.get("tools"), "tools")
    for index, tool in enumerate(tools or []):
        if tool["type"] == "function" and not isinstance(tool.get("parameters", {}),
                                                         (dict, type(None))):
            raise APIError(400, f"tools[{index}].parameters must be a JSON schema object",
                           param="tools", code="invalid_value")
    choice = body.get("tool_choice")
    if choice is not None and choice not in TOOL_CHOICES and not (
            isinstance(choice, dict) and isinstance(choice.get("type"), str)):
        raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or an object "
                       "with a type", param="tool_choice", code="invalid_value")
    check_number(body, "temperature", 0.0, 2.0)
    check_number(body, "top_p", 0.0, 1.0, low_open=True)
    check_max_tokens(body, "max_output_tokens")
    for name in ("stream", "parallel_tool_calls", "store", "background"):
        check_type(body, name, bool, "a boolean")
    check_type(body, "metadata", dict, "an object")
    check_type(body, "include", list, "an array")
    check_seed(body)
    stored = normalised(lambda _: stored_call(ProviderApi.OPENAI_RESPONSES, items,
                                              instructions, tools, prior=prior or None),
                        None, "input")
    view = chat_view(ProviderApi.OPENAI_RESPONSES, stored)
    native = native_request(ProviderApi.OPENAI_RESPONSES, stored)
    return ResponsesRequest(body=body, native_input=stored["input"],
                            instructions=native.get("instructions"),
                            native_tools=native.get("tools"),
                            messages=view.messages, tools=view.tools)


def _unstored_calls(value: Any, *, continues: bool) -> list[dict[str, Any]]:
    """A request that continues a stored response may answer its calls: stand-ins for them
    (the calls are the upstream's to know; nothing here holds them)."""
    if not continues or not isinstance(value, list):
        return []
    return [{"type": "function_call", "call_id": item.get("call_id")}
            for item in value if isinstance(item, dict)]


def output_items(generation: Generation, *, is_incomplete: bool) -> list[dict[str, Any]]:
    """The output as Responses items (`responses.items_of`: a message with the text, then the
    function calls), with the ids and statuses the wire carries; no calls: a message always."""
    calls = generation.tool_calls
    text = (generation.message.get("content") or "") if calls else generation.text
    items = responses.items_of({"role": "assistant", "content": text, "tool_calls": calls})
    if not calls and not text:
        items = [{"type": "message", "role": "assistant",
                  "content": [{"type": "output_text", "text": ""}]}]
    for item in items:
        if item["type"] == "message":
            item.update(id=f"msg_{uuid.uuid4().hex[:24]}",
                        status="incomplete" if is_incomplete else "completed")
            item["content"] = [{**part, "annotations": []} for part in item["content"]]
        else:
            item.update(id="fc_" + item["call_id"].removeprefix("call_"), status="completed")
    return items


class ResponsesReply:
    """The local engine's answer to a Responses request (see the module docstring)."""

    def __init__(self, request: ResponsesRequest, generation: Generation, *, model: str) -> None:
        self.request = request
        self.generation = generation
        self.model = model
        body = request.body
        is_incomplete = not generation.tool_calls and generation.finish_reason == "length"
        self.usage = {
            "input_tokens": generation.prompt_tokens,
            "input_tokens_details": {"cached_tokens": generation.reused_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": generation.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": generation.prompt_tokens + generation.completion_tokens,
        }
        self.body: dict[str, Any] = {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response",
            "created_at": int(time.time()),
            "status": "incomplete" if is_incomplete else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if is_incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": body.get("max_output_tokens"),
            "model": model,
            "output": output_items(generation, is_incomplete=is_incomplete),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": body.get("reasoning"),
            "store": False,  # nothing is kept to be fetched or continued by id
            "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": request.native_tools or [],
            "top_p": body.get("top_p"),
            "truncation": body.get("truncation", "disabled"),
            "usage": self.usage,
            "metadata": body.get("metadata") or {},
        }

    def events(self) -> Iterator[bytes]:
        return (encode_event(event) for event in responses.stream_events(self.body))

    def step(self, url: str, *, is_complete: bool = True) -> StepWrite:
        request = self.request
        return native_step(self, url, is_complete=is_complete, endpoint=RESPONSES,
                           conversation=request.native_input, system=request.instructions,
                           tools=request.native_tools, finish_reason=responses.finish_reason)
