"""The request bodies of the three model-call routes, as `kvtrace serve` documents them.

FastAPI builds the rest of `GET /openapi.json` from the routes; the
model-call routes' handlers read the raw body (it must forward it byte for
byte upstream), so their JSON schemas are written here, once, stating what
api.py's `parse_chat_request`, anthropic_api.py's `parse_messages_request`
and responses_api.py's `parse_responses_request` accept. Bodies outside
them are 4xx answers that record nothing; tests/serve/test_openapi_fuzz.py
holds the server to both with schemathesis. Fields not listed are allowed
(passed on upstream, recorded as params locally). `model` is any string,
or the one name a `--strict-model` server answers to.
"""

from __future__ import annotations

from typing import Any

_TEXT_OR_PARTS: dict[str, Any] = {"anyOf": [
    {"type": "string"},
    {"type": "null"},
    {"type": "array", "items": {"type": "object", "required": ["type"],
                                "properties": {"type": {"type": "string"},
                                               "text": {"type": "string"}}}},
]}
_TOOL_CALL: dict[str, Any] = {
    "type": "object", "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"],
                     "properties": {"name": {"type": "string", "minLength": 1},
                                    "arguments": {"type": "string"}}},
    },
}
_MESSAGE: dict[str, Any] = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": _TEXT_OR_PARTS,
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": _TOOL_CALL},
    },
}
_TOOL: dict[str, Any] = {
    "type": "object", "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "minLength": 1},
                                    "description": {"type": "string"},
                                    "parameters": {"type": "object"}}},
    },
}
_POSITIVE_INT: dict[str, Any] = {"type": "integer", "minimum": 1}


def _model(model: str | None) -> dict[str, Any]:
    return {"enum": [model]} if model is not None else {"type": "string", "minLength": 1}


def chat_request_schema(model: str | None = None, *, is_local: bool = False) -> dict[str, Any]:
    """The chat request body; `model` is the one name a strict server answers to."""
    return {
        "type": "object", "required": ["model", "messages"],
        "properties": {
            "model": _model(model),
            "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
            "tools": {"type": "array", "items": _TOOL},
            "tool_choice": {"anyOf": [
                {"enum": ["none", "auto", "required"]},
                {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"const": "function"},
                                "function": {"type": "object", "required": ["name"],
                                             "properties": {"name": {"type": "string"}}}}},
            ]},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "seed": {"type": "integer"},
            "max_tokens": _POSITIVE_INT,
            "max_completion_tokens": _POSITIVE_INT,
            "stop": {"anyOf": [{"type": "string"},
                               {"type": "array", "maxItems": 4, "items": {"type": "string"}}]},
            "n": {"const": 1} if is_local else _POSITIVE_INT,
            "stream": {"type": "boolean"},
            "stream_options": {"type": "object",
                               "properties": {"include_usage": {"type": "boolean"}}},
        },
    }


# -- Anthropic Messages --------------------------------------------------------------------

_ANTHROPIC_TEXT: dict[str, Any] = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"const": "text"}, "text": {"type": "string"}}}
_ANTHROPIC_BLOCK: dict[str, Any] = {"anyOf": [
    _ANTHROPIC_TEXT,
    {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
        "type": {"const": "tool_use"}, "id": {"type": "string"},
        "name": {"type": "string", "minLength": 1}, "input": {"type": "object"}}},
    {"type": "object", "required": ["type", "tool_use_id"], "properties": {
        "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _ANTHROPIC_TEXT}]},
        "is_error": {"type": "boolean"}}},
]}
_ANTHROPIC_TOOL: dict[str, Any] = {
    "type": "object", "required": ["name", "input_schema"],
    "properties": {"name": {"type": "string", "minLength": 1},
                   "description": {"type": "string"}, "input_schema": {"type": "object"}},
}


def messages_request_schema(model: str | None = None) -> dict[str, Any]:
    """The Anthropic Messages request body (a `tool_result` must answer an earlier
    `tool_use`, which a schema cannot say)."""
    return {
        "type": "object", "required": ["model", "max_tokens", "messages"],
        "properties": {
            "model": _model(model),
            "max_tokens": _POSITIVE_INT,
            "messages": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["role", "content"],
                "properties": {"role": {"enum": ["user", "assistant"]},
                               "content": {"anyOf": [{"type": "string"}, {
                                   "type": "array", "items": _ANTHROPIC_BLOCK}]}}}},
            "system": {"anyOf": [{"type": "string"},
                                 {"type": "array", "items": _ANTHROPIC_TEXT}]},
            "tools": {"type": "array", "items": _ANTHROPIC_TOOL},
            "tool_choice": {"type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["auto", "any", "tool", "none"]},
                "name": {"type": "string"}}},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "stop_sequences": {"type": "array", "items": {"type": "string"}},
            "stream": {"type": "boolean"},
            "metadata": {"type": "object"},
        },
    }


# -- OpenAI Responses ----------------------------------------------------------------------

_RESPONSES_ITEM: dict[str, Any] = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"},
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": ["input_text", "output_text"]},
                           "text": {"type": "string"}}}}]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": {"type": "string", "minLength": 1},
        "name": {"type": "string", "minLength": 1}, "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"},
        "call_id": {"type": "string", "minLength": 1}, "output": {"type": "string"}}},
]}
_RESPONSES_TOOL: dict[str, Any] = {
    "type": "object", "required": ["type", "name"],
    "properties": {"type": {"const": "function"}, "name": {"type": "string", "minLength": 1},
                   "description": {"type": "string"}, "parameters": {"type": "object"},
                   "strict": {"type": "boolean"}},
}


def responses_request_schema(model: str | None = None, *,
                             is_local: bool = False) -> dict[str, Any]:
    """The OpenAI Responses request body (a `function_call_output` must answer an earlier
    `function_call`, which a schema cannot say)."""
    schema: dict[str, Any] = {
        "type": "object", "required": ["model", "input"],
        "properties": {
            "model": _model(model),
            "input": {"anyOf": [{"type": "string", "minLength": 1},
                                {"type": "array", "minItems": 1, "items": _RESPONSES_ITEM}]},
            "instructions": {"type": "string"},
            "tools": {"type": "array", "items": _RESPONSES_TOOL},
            "tool_choice": {"anyOf": [
                {"enum": ["none", "auto", "required"]},
                {"type": "object", "required": ["type", "name"],
                 "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}]},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "max_output_tokens": _POSITIVE_INT,
            "stream": {"type": "boolean"},
            "parallel_tool_calls": {"type": "boolean"},
            "store": {"type": "boolean"},
            "metadata": {"type": "object"},
        },
    }
    if is_local:  # local mode keeps no responses to continue from
        schema["not"] = {"anyOf": [{"required": [name]} for name in (
            "previous_response_id", "conversation", "prompt")]}
    return schema


def _operation(schema: dict[str, Any], answer: str, error: str) -> dict[str, Any]:
    """A route's `openapi_extra`: its request body and the answers it gives."""
    failure = {"description": f"{error}; nothing is recorded",
               "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            "200": {"description": f"{answer}; recorded as a model_call step",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **{status: failure for status in ("400", "401", "404", "409", "413", "415", "429",
                                              "502", "504")},
        },
    }


def chat_operation(model: str | None = None, *, is_local: bool = False) -> dict[str, Any]:
    """The chat route's `openapi_extra`."""
    return _operation(chat_request_schema(model, is_local=is_local),
                      "a chat completion, or an SSE stream of chunks when `stream` is true",
                      "an OpenAI-style error body")


def messages_operation(model: str | None = None) -> dict[str, Any]:
    """The Anthropic Messages route's `openapi_extra`."""
    return _operation(messages_request_schema(model),
                      "a Messages `message`, or its SSE events when `stream` is true",
                      "an Anthropic-style error body ({type: error, error: {type, message}})")


def responses_operation(model: str | None = None, *, is_local: bool = False) -> dict[str, Any]:
    """The OpenAI Responses route's `openapi_extra`."""
    return _operation(responses_request_schema(model, is_local=is_local),
                      "a `response` object, or its SSE events when `stream` is true",
                      "an OpenAI-style error body")
