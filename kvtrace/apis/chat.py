"""The model-call format: OpenAI chat messages, responses and tool lists, normalised.

What `Run.record_model_call` stores (docs/store.md, "Model calls"):

- a **message** is a dict with `role` (system, developer, user, assistant,
  tool, function) and `content` (a string, null, or a list of content parts,
  each a dict with a `type`); an assistant message may carry `tool_calls`
  (each ``{"id", "type": "function", "function": {"name", "arguments"}}``,
  arguments a JSON *string* as in OpenAI's API; ids distinct within the
  message) and `reasoning_content`; a
  tool message carries the `tool_call_id` it answers; `name` is kept where
  given. Other keys a provider adds are kept as they are.
- the **response** is the assistant message the call returned;
- **tools** is the request's list of tool definitions
  (``{"type": "function", "function": {"name", "description", "parameters"}}``).

Normalising makes equal messages equal bytes, so each distinct message is
stored once and the prompt renders identically wherever it came from: SDK
objects (pydantic models such as the `openai` package's, dataclasses) become
plain dicts; keys whose value is null are dropped, except `content`, which
every message has; tool-call arguments given as a dict become a JSON string;
a plain-string response becomes an assistant message. Anything that is not
of this shape is a UsageError naming the offending element.

Streaming. A streamed chat completion is a sequence of `data: {chunk}`
events ending with `data: [DONE]`; each chunk carries a `delta` of the
message (role, content pieces, tool-call pieces keyed by `index`) and, at
the end, a `finish_reason` and (with `stream_options.include_usage`) the
usage. `assemble` turns the bytes of a stream into the one non-streamed
completion they add up to (what the store records); `stream_bytes` is its
inverse up to chunking (what a replaying transport and the local server send).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from kvtrace.apis.plain import to_plain
from kvtrace.apis.sse import events
from kvtrace.errors import UsageError

DONE = b"[DONE]"
# Request fields that are not parameters: the conversation, the tools, the model, streaming.
NOT_PARAMS = frozenset({"messages", "tools", "model", "stream", "stream_options"})
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """A list of chat messages in the stored form (see the module docstring)."""
    plain = to_plain(messages)
    if not isinstance(plain, list):
        raise UsageError("messages must be a list of chat messages (OpenAI chat format)")
    return [normalize_message(m, f"messages[{i}]") for i, m in enumerate(plain)]


def normalize_message(message: Any, where: str = "message") -> dict[str, Any]:
    """One chat message in the stored form."""
    plain = to_plain(message)
    if not isinstance(plain, dict):
        raise UsageError(f"{where} must be an object with role and content")
    role = plain.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or dict is not hashable
        raise UsageError(f"{where}.role is {role!r}: use one of {', '.join(sorted(ROLES))}")
    out: dict[str, Any] = {key: value for key, value in plain.items() if value is not None}
    out["content"] = _content(plain.get("content"), f"{where}.content")
    for key in ("tool_call_id", "name", "reasoning_content"):
        if key in out and not isinstance(out[key], str):
            raise UsageError(f"{where}.{key} must be a string")
    if "tool_calls" in out:
        calls = out["tool_calls"]
        if not isinstance(calls, list):
            raise UsageError(f"{where}.tool_calls must be a list")
        if calls:
            out["tool_calls"] = [
                _tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)
            ]
            _check_ids_unique(out["tool_calls"], where)
        else:
            del out["tool_calls"]  # an empty list says nothing: store it as absent
    return out


def normalize_response(response: Any) -> dict[str, Any]:
    """The assistant message a model call returned.

    Takes an assistant message, a plain string (its text), or a whole chat
    completion (its first choice's message).
    """
    plain = to_plain(response)
    if isinstance(plain, str):
        return {"role": "assistant", "content": plain}
    if isinstance(plain, dict) and "choices" in plain and "role" not in plain:
        choices = plain["choices"]
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise UsageError("response is a chat completion without choices")
        plain = choices[0].get("message")
    if isinstance(plain, dict) and "role" not in plain:
        plain = {"role": "assistant", **plain}
    message = normalize_message(plain, "response")
    if message["role"] != "assistant":
        raise UsageError(
            f"response.role is {message['role']!r}: a response is an assistant message"
        )
    return message


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tool definitions, or None when there are none."""
    plain = to_plain(tools)
    if plain is None or plain == []:
        return None
    if not isinstance(plain, list):
        raise UsageError("tools must be a list of tool definitions")
    out = []
    for index, tool in enumerate(plain):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise UsageError(f"{where} must be an object")
        if "type" not in tool and "name" in tool:  # a bare function definition
            tool = {"type": "function", "function": tool}
        function = tool.get("function")
        if tool.get("type") == "function" and not (
            isinstance(function, dict) and isinstance(function.get("name"), str)
            and function["name"]
        ):
            raise UsageError(f"{where}.function needs a name")
        out.append({key: value for key, value in tool.items() if value is not None})
    return out


def tool_calls_of(message: Mapping[str, Any] | Any) -> list[dict[str, Any]]:
    """The tool calls of a stored assistant message ([] for none or a plain string)."""
    if not isinstance(message, Mapping):
        return []
    calls = message.get("tool_calls")
    return list(calls) if isinstance(calls, list) else []


def arguments_equal(a: str, b: str) -> bool:
    """Whether two tool-call argument strings are equal as JSON (else as text)."""
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return a == b


def _content(content: Any, where: str) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        for index, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise UsageError(f"{where}[{index}] must be a content part with a type")
        return [{k: v for k, v in part.items() if v is not None} for part in content]
    raise UsageError(f"{where} must be a string, null or a list of content parts")


def _check_ids_unique(calls: list[dict[str, Any]], where: str) -> None:
    """A tool result names the call it answers by id, so one message cannot use an id twice."""
    seen: set[str] = set()
    for index, call in enumerate(calls):
        if "id" in call:
            if call["id"] in seen:
                raise UsageError(f"{where}.tool_calls[{index}]: id {call['id']!r} is used twice "
                                 "in this message (a tool result could not say which it answers)")
            seen.add(call["id"])


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise UsageError(f"{where} must be an object")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not (
        function["name"]
    ):
        raise UsageError(f"{where}.function needs a name")
    arguments = function.get("arguments", "")
    if arguments is None:
        arguments = ""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    out = {key: value for key, value in call.items() if value is not None}
    if "id" in out and not isinstance(out["id"], str):
        raise UsageError(f"{where}.id must be a string")
    out["type"] = out.get("type", "function")
    out["function"] = {
        **{key: value for key, value in function.items() if value is not None},
        "arguments": arguments,
    }
    return out


def is_finished(data: bytes) -> bool:
    """Whether the stream so far ends with its `data: [DONE]` event."""
    return data.rstrip().endswith(b"data: " + DONE) or data.rstrip().endswith(b"data:" + DONE)


def assemble(data: bytes) -> dict[str, Any]:
    """The chat completion a chat-completions SSE stream adds up to.

    Raises ValueError when an event is not JSON or not a chunk.
    """
    completion: dict[str, Any] = {"object": "chat.completion"}
    message: dict[str, Any] = {"role": "assistant", "content": None}
    calls: dict[int, dict[str, Any]] = {}
    finish_reason = None
    for payload in events(data):
        if payload.strip() == DONE:
            break
        chunk = json.loads(payload)
        if not isinstance(chunk, dict):
            raise ValueError("an SSE event is not a JSON object")
        for key in ("id", "created", "model", "system_fingerprint", "service_tier"):
            if chunk.get(key) is not None:
                completion[key] = chunk[key]
        if isinstance(chunk.get("usage"), dict):
            completion["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            finish_reason = choice.get("finish_reason") or finish_reason
            delta = choice.get("delta") or {}
            if delta.get("role"):
                message["role"] = delta["role"]
            for key in ("content", "reasoning_content", "refusal"):
                if isinstance(delta.get(key), str):
                    message[key] = (message.get(key) or "") + delta[key]
            for piece in delta.get("tool_calls") or []:
                call = calls.setdefault(int(piece.get("index", len(calls))), {
                    "id": None, "type": "function", "function": {"name": "", "arguments": ""},
                })
                if piece.get("id"):
                    call["id"] = piece["id"]
                function = piece.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    completion["choices"] = [{"index": 0, "message": message, "finish_reason": finish_reason}]
    return completion


def includes_usage(request: Mapping[str, Any]) -> bool:
    """Whether a streamed chat request asks for the usage chunk (`stream_options`)."""
    options = request.get("stream_options")
    return isinstance(options, Mapping) and bool(options.get("include_usage"))


def stream_bytes(completion: Mapping[str, Any], *, include_usage: bool = False) -> bytes:
    """SSE bytes of a completion: a role chunk, content, tool calls, the finish, [DONE]."""
    return b"".join(stream_events(completion, include_usage=include_usage))


def stream_events(completion: Mapping[str, Any], *, include_usage: bool = False) -> Iterator[bytes]:
    """The events of `stream_bytes`, one `data: ...\\n\\n` each."""
    head = {
        key: completion[key]
        for key in ("id", "created", "model", "system_fingerprint", "service_tier")
        if completion.get(key) is not None
    }
    head["object"] = "chat.completion.chunk"
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}

    def event(delta: dict[str, Any], finish: Any = None, **extra: Any) -> bytes:
        chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                 **extra}
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

    yield event({"role": message.get("role", "assistant"), "content": ""})
    for key in ("reasoning_content", "content"):
        if message.get(key):
            yield event({key: message[key]})
    for index, call in enumerate(message.get("tool_calls") or []):
        yield event({"tool_calls": [{"index": index, **call}]})
    yield event({}, choice.get("finish_reason"))
    if include_usage and completion.get("usage") is not None:
        yield b"data: " + json.dumps(
            {**head, "choices": [], "usage": completion["usage"]}
        ).encode() + b"\n\n"
    yield b"data: " + DONE + b"\n\n"
