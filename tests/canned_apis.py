"""Canned Anthropic Messages and OpenAI Responses upstreams on loopback, written here by hand.

`CannedAnthropic` answers `POST /v1/messages` and `CannedResponses` answers
`POST /v1/responses` the way the providers document it: whole JSON
responses, or SSE streams sent event by event (Anthropic: `message_start`,
a `ping`, thinking deltas and a `signature_delta`, text deltas word by word,
a tool input's JSON in three pieces, `message_delta`, `message_stop`;
Responses: `response.created`, `response.in_progress`, each item's added /
delta / done events with growing `sequence_number`s, `response.completed`).
The events are written by this module, never by kvtrace's own writers, so a
test that kvtrace reads them right is not a round trip of kvtrace's code.

What they answer depends on the request's last user text:

- a tool result last: a text answer, unless the tool is `bash` (a coding
  agent, which goes on calling it); otherwise, with tools, a short text and
  a tool call (Anthropic: thinking first when `thinking` is enabled;
  Responses: a reasoning item first when `reasoning` is set);
- "cut": a stream that stops halfway through a tool call and closes;
- "unknown": a stream with an event type the provider might add one day;
- "error": a stream that ends with an `error` event (overloaded);
- "malformed": a 200 whose tool call lacks its id;
- "incomplete" / "failed" (Responses): a response that ends so.

Each answer is numbered (`num_calls`): ids, the tool's input and the usage
change with it, as a real conversation's do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from tests.canned import CannedServer, Reply

ANTHROPIC_MODEL = "claude-canned-4-5-20250929"
RESPONSES_MODEL = "gpt-canned-5-2025-08-07"
SIGNATURE = "EqQBCkYIBhgCKkDcanned" + "Zm9vYmFy" * 24  # base64-looking, as real signatures are


class _Server(CannedServer):
    """A canned server that hands each POST body of its API's `path` to `answer`, or to
    `events` when it asks for a stream."""

    path = ""
    prefix = ""

    def on_post(self, reply: Reply, path: str, data: bytes, number: int) -> None:
        if path != self.path:
            reply.send(404, b'{"error": "no such path"}')
            return
        body = json.loads(data)
        if body.get("stream"):
            reply.stream(list(self.events(body, number)), no_cache=True)
            return
        reply.send(200, json.dumps(self.answer(body, number)).encode())

    def answer(self, body: dict[str, Any], number: int) -> dict[str, Any]:
        raise NotImplementedError

    def events(self, body: dict[str, Any], number: int) -> Iterator[bytes]:
        raise NotImplementedError


def _words(text: str) -> list[str]:
    """Text split into delta-sized pieces that join back to it."""
    pieces = text.split(" ")
    return [p + " " for p in pieces[:-1]] + [pieces[-1]]


def _thirds(text: str) -> list[str]:
    step = max(1, len(text) // 3)
    return [text[:step], text[step:2 * step], text[2 * step:]]


def _tool_input(name: str, number: int) -> dict[str, Any]:
    if name == "bash":
        return {"command": f"sed -n '{number * 40},{number * 40 + 39}p' src/core.py"}
    return {"city": "Paris", "units": "celsius"}


def _is_coding(body: dict[str, Any]) -> bool:
    """Whether the request is the coding agent's, which calls `bash` call after call."""
    return any(tool.get("name") == "bash" for tool in body.get("tools") or [])


def last_user_text(turns: list[dict[str, Any]]) -> str:
    """The text of the last turn of a conversation (Anthropic messages or Responses input)."""
    last = turns[-1] if turns else {}
    content = last.get("content", last.get("output", ""))
    if isinstance(content, str):
        return content
    return "".join(str(b.get("text", "")) for b in content if isinstance(b, dict))


class CannedAnthropic(_Server):
    """Answers POST /v1/messages as Anthropic does (see the module docstring)."""

    path = "/v1/messages"

    def answer(self, body: dict[str, Any], number: int) -> dict[str, Any]:
        messages = body["messages"]
        last = messages[-1]
        is_result = isinstance(last["content"], list) and any(
            b.get("type") == "tool_result" for b in last["content"]) and not _is_coding(body)
        blocks: list[dict[str, Any]] = []
        if (body.get("thinking") or {}).get("type") == "enabled":
            blocks.append({"type": "thinking", "signature": SIGNATURE + str(number),
                           "thinking": f"The user asks about the weather (turn {number}). "
                                       "I should call the tool first."})
        if is_result:
            blocks.append({"type": "text",
                           "text": f"It is sunny in Paris, 21 C (answer {number})."})
            stop = "end_turn"
        elif body.get("tools"):
            name = body["tools"][0]["name"]
            blocks.append({"type": "text", "text": "Let me check that for you."})
            blocks.append({"type": "tool_use", "id": f"toolu_01Canned{number:04d}", "name": name,
                           "input": _tool_input(name, number)})
            stop = "tool_use"
        else:
            blocks.append({"type": "text", "text": "Hello! How can I help you today?"})
            stop = "end_turn"
        if last_user_text(messages) == "malformed":
            blocks = [{"type": "tool_use", "name": "get_weather", "input": {}}]
        return {
            "id": f"msg_01Canned{number:04d}", "type": "message", "role": "assistant",
            "model": ANTHROPIC_MODEL, "content": blocks, "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": 12 + number, "cache_creation_input_tokens": 96,
                      "cache_read_input_tokens": 1024 + 64 * number, "output_tokens": 30 + number,
                      "service_tier": "standard",
                      "cache_creation": {"ephemeral_5m_input_tokens": 96,
                                         "ephemeral_1h_input_tokens": 0}},
        }

    def events(self, body: dict[str, Any], number: int) -> Iterator[bytes]:
        message = self.answer(body, number)
        variant = last_user_text(body["messages"])
        usage = message["usage"]

        def event(data: dict[str, Any]) -> bytes:
            return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()

        start = {k: v for k, v in message.items() if k not in ("content", "usage")}
        yield event({"type": "message_start", "message": {
            **start, "content": [], "stop_reason": None,
            "usage": {**usage, "output_tokens": 1}}})
        yield event({"type": "ping"})
        for index, block in enumerate(message["content"]):
            kind = block["type"]
            if kind == "thinking":
                yield event({"type": "content_block_start", "index": index,
                             "content_block": {"type": "thinking", "thinking": ""}})
                for piece in _thirds(block["thinking"]):
                    yield event({"type": "content_block_delta", "index": index,
                                 "delta": {"type": "thinking_delta", "thinking": piece}})
                yield event({"type": "content_block_delta", "index": index,
                             "delta": {"type": "signature_delta",
                                       "signature": block["signature"]}})
            elif kind == "text":
                yield event({"type": "content_block_start", "index": index,
                             "content_block": {"type": "text", "text": ""}})
                for piece in _words(block["text"]):
                    yield event({"type": "content_block_delta", "index": index,
                                 "delta": {"type": "text_delta", "text": piece}})
                if variant == "unknown":
                    yield event({"type": "content_block_glimmer", "index": index,
                                 "glimmer": {"level": 3}})
            else:
                yield event({"type": "content_block_start", "index": index,
                             "content_block": {**block, "input": {}}})
                pieces = _thirds(json.dumps(block["input"]))
                if variant == "cut":
                    yield event({"type": "content_block_delta", "index": index,
                                 "delta": {"type": "input_json_delta",
                                           "partial_json": pieces[0]}})
                    return  # the connection closes mid-block
                for piece in pieces:
                    yield event({"type": "content_block_delta", "index": index,
                                 "delta": {"type": "input_json_delta", "partial_json": piece}})
            yield event({"type": "content_block_stop", "index": index})
            if variant == "error":
                yield event({"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "Overloaded"}})
                return
        yield event({"type": "message_delta",
                     "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                     "usage": {"output_tokens": usage["output_tokens"]}})
        yield event({"type": "message_stop"})


class CannedResponses(_Server):
    """Answers POST /v1/responses as OpenAI does (see the module docstring)."""

    path = "/v1/responses"

    def answer(self, body: dict[str, Any], number: int) -> dict[str, Any]:
        items = body["input"]
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        variant = last_user_text(items)
        is_result = (bool(items) and items[-1].get("type") == "function_call_output"
                     and not _is_coding(body))
        output: list[dict[str, Any]] = []
        if body.get("reasoning"):
            reasoning = {"type": "reasoning", "id": f"rs_canned{number:04d}",
                         "summary": [{"type": "summary_text",
                                      "text": f"**Checking the weather** (turn {number})"}]}
            if "reasoning.encrypted_content" in (body.get("include") or []):
                reasoning["encrypted_content"] = "gAAAAABcanned" + "QUJD" * 30 + str(number)
            output.append(reasoning)
        tools = body.get("tools") or []
        if is_result or not tools or variant in ("incomplete", "failed"):
            text = (f"It is sunny in Paris, 21 C (answer {number})." if is_result
                    else "Hello! How can I help you today?")
            output.append({"type": "message", "id": f"msg_canned{number:04d}",
                           "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": []}]})
        else:
            name = tools[0]["name"]
            output.append({"type": "function_call", "id": f"fc_canned{number:04d}",
                           "call_id": f"call_canned{number:04d}", "name": name,
                           "arguments": json.dumps(_tool_input(name, number)),
                           "status": "completed"})
        if variant == "malformed":
            output = [{"type": "function_call", "id": "fc_x", "name": "get_weather",
                       "arguments": "{}", "status": "completed"}]
        status = {"incomplete": "incomplete", "failed": "failed"}.get(variant, "completed")
        return {
            "id": f"resp_canned{number:04d}", "object": "response",
            "created_at": 1760000000 + number, "status": status, "background": False,
            "error": ({"code": "server_error", "message": "The model failed."}
                      if status == "failed" else None),
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": RESPONSES_MODEL,
            "output": output if status != "failed" else [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"),
                          "summary": None},
            "store": body.get("store", True), "temperature": body.get("temperature", 1.0),
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": body.get("tool_choice", "auto"),
            # OpenAI echoes the tools with its defaults filled in.
            "tools": [{"strict": True, **tool} for tool in tools],
            "top_p": 1.0, "truncation": "disabled", "user": None, "metadata": {},
            "usage": {"input_tokens": 900 + 40 * number,
                      "input_tokens_details": {"cached_tokens": 768 + 32 * number},
                      "output_tokens": 20 + number,
                      "output_tokens_details": {"reasoning_tokens": 12},
                      "total_tokens": 920 + 41 * number},
        }

    def events(self, body: dict[str, Any], number: int) -> Iterator[bytes]:
        response = self.answer(body, number)
        items = body["input"]
        variant = last_user_text([{"content": items}] if isinstance(items, str) else items)
        numbers = iter(range(10_000))

        def event(data: dict[str, Any]) -> bytes:
            data = {"type": data["type"], "sequence_number": next(numbers), **data}
            return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()

        start = {**response, "status": "in_progress", "output": [], "usage": None,
                 "error": None, "incomplete_details": None}
        yield event({"type": "response.created", "response": start})
        yield event({"type": "response.in_progress", "response": start})
        if variant == "unknown":
            yield event({"type": "rate_limits.updated", "rate_limits": [
                {"name": "requests", "limit": 500, "remaining": 499, "reset_seconds": 0.12}]})
        for index, item in enumerate(response["output"]):
            at = {"item_id": item["id"], "output_index": index}
            kind = item["type"]
            if kind == "reasoning":
                yield event({"type": "response.output_item.added", "output_index": index,
                             "item": {"type": "reasoning", "id": item["id"], "summary": []}})
                text = item["summary"][0]["text"]
                yield event({"type": "response.reasoning_summary_part.added", **at,
                             "summary_index": 0, "part": {"type": "summary_text", "text": ""}})
                for piece in _thirds(text):
                    yield event({"type": "response.reasoning_summary_text.delta", **at,
                                 "summary_index": 0, "delta": piece, "obfuscation": "kX9"})
                yield event({"type": "response.reasoning_summary_text.done", **at,
                             "summary_index": 0, "text": text})
                yield event({"type": "response.reasoning_summary_part.done", **at,
                             "summary_index": 0, "part": {"type": "summary_text", "text": text}})
            elif kind == "message":
                yield event({"type": "response.output_item.added", "output_index": index,
                             "item": {**item, "status": "in_progress", "content": []}})
                part = item["content"][0]
                yield event({"type": "response.content_part.added", **at, "content_index": 0,
                             "part": {**part, "text": ""}})
                for piece in _words(part["text"]):
                    yield event({"type": "response.output_text.delta", **at, "content_index": 0,
                                 "delta": piece, "logprobs": [], "obfuscation": "q1"})
                yield event({"type": "response.output_text.done", **at, "content_index": 0,
                             "text": part["text"], "logprobs": []})
                yield event({"type": "response.content_part.done", **at, "content_index": 0,
                             "part": part})
            else:
                yield event({"type": "response.output_item.added", "output_index": index,
                             "item": {**item, "status": "in_progress", "arguments": ""}})
                pieces = _thirds(item["arguments"])
                for number_of_piece, piece in enumerate(pieces):
                    yield event({"type": "response.function_call_arguments.delta", **at,
                                 "delta": piece, "obfuscation": "Zz"})
                    if variant == "cut" and number_of_piece == 0:
                        return  # the connection closes mid-item
                yield event({"type": "response.function_call_arguments.done", **at,
                             "name": item["name"], "arguments": item["arguments"]})
            yield event({"type": "response.output_item.done", "output_index": index,
                         "item": item})
            if variant == "error":
                yield event({"type": "error", "code": "server_error", "param": None,
                             "message": "The server had an error while processing your "
                                        "request."})
                return
        terminal = {"completed": "response.completed", "incomplete": "response.incomplete",
                    "failed": "response.failed"}[response["status"]]
        yield event({"type": terminal, "response": response})
