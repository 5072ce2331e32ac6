"""The request body of `POST /v1/chat/completions` as `kvtrace serve` documents it (OpenAPI 3.1).

FastAPI builds the rest of `GET /openapi.json` from the routes; the chat
route's handler reads the raw body (it must forward it byte for byte
upstream), so its JSON schema is written here, once, stating what
api.py's `parse_chat_request` accepts. Bodies outside it are 4xx answers
that record nothing; tests/serve/test_openapi_fuzz.py holds the server
to both with schemathesis. Fields not listed are allowed (passed on
upstream, recorded as params locally).
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


def chat_request_schema(model: str | None = None) -> dict[str, Any]:
    """The chat request body; `model` is the one name a local server answers to."""
    return {
        "type": "object", "required": ["model", "messages"],
        "properties": {
            "model": {"enum": [model]} if model is not None else {"type": "string"},
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
            "n": {"const": 1} if model is not None else _POSITIVE_INT,
            "stream": {"type": "boolean"},
            "stream_options": {"type": "object",
                               "properties": {"include_usage": {"type": "boolean"}}},
        },
    }


def chat_operation(model: str | None = None) -> dict[str, Any]:
    """The route's `openapi_extra`: its request body and the answers it gives."""
    error = {"description": "an OpenAI-style error body; nothing is recorded",
             "content": {"application/json": {"schema": {
                 "type": "object", "required": ["error"],
                 "properties": {"error": {"type": "object"}}}}}}
    return {
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": chat_request_schema(model)}}},
        "responses": {
            "200": {"description": "a chat completion, or an SSE stream of chunks when "
                    "`stream` is true; recorded as a model_call step",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **{status: error for status in ("400", "401", "404", "409", "413", "415", "429",
                                            "502", "504")},
        },
    }
