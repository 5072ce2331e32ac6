"""A canned upstream that speaks Anthropic Messages and OpenAI Responses, for `serve --upstream`.

`CannedApis` (on tests/canned.py's one `CannedServer`) answers with
fixed bytes — odd spacing and key order included, so "returned unchanged"
means byte for byte:

- `POST /v1/messages`: CANNED_MESSAGE (a text and a `tool_use` block, usage
  with cache reads and writes), or the same as CANNED_MESSAGE_STREAM when
  `stream` is true (a `ping` among the events);
- `POST /v1/responses` without tools: CANNED_RESPONSE, or
  CANNED_RESPONSE_STREAM when streamed;
- `POST /v1/responses` with function tools: a scripted agent's model, in
  order: a `function_call` of the first tool, once its output is in the
  input a call of the second, and so on, then a text answer naming every
  output it was given (`{"city": "Paris"}` as every call's arguments), so
  an agent run against it is deterministic. Streamed too when asked.

A request whose last user text is "hang" gets its first two stream events
and then nothing until `release` is set; `abandoned` lists the paths whose
client closed the connection meanwhile. `seen` holds each request's path,
headers and body.
"""

from __future__ import annotations

import json
from typing import Any

from tests.canned import CannedServer, Reply

CANNED_MESSAGE = (
    b'{"id":"msg_canned_1", "type":"message","role":"assistant","model":"claude-canned",\n'
    b'"content":[{"type":"text","text":"Let me check."},{"type":"tool_use","id":"toolu_c1",'
    b'"name":"get_weather","input":{"city":"Paris"}}],"stop_reason":"tool_use",'
    b'"stop_sequence":null,"usage":{"input_tokens":12,"cache_creation_input_tokens":20,'
    b'"cache_read_input_tokens":30,"output_tokens":9}}'
)
_MESSAGE_EVENTS = [
    ("message_start", '{"type":"message_start","message":{"id":"msg_canned_s","type":"message",'
     '"role":"assistant","model":"claude-canned","content":[],"stop_reason":null,'
     '"stop_sequence":null,"usage":{"input_tokens":12,"cache_creation_input_tokens":20,'
     '"cache_read_input_tokens":30,"output_tokens":1}}}'),
    ("content_block_start", '{"type":"content_block_start","index":0,"content_block":'
     '{"type":"text","text":""}}'),
    ("ping", '{"type": "ping"}'),
    ("content_block_delta", '{"type":"content_block_delta","index":0,"delta":'
     '{"type":"text_delta","text":"Let me "}}'),
    ("content_block_delta", '{"type":"content_block_delta","index":0,"delta":'
     '{"type":"text_delta","text":"check."}}'),
    ("content_block_stop", '{"type":"content_block_stop","index":0}'),
    ("content_block_start", '{"type":"content_block_start","index":1,"content_block":'
     '{"type":"tool_use","id":"toolu_s1","name":"get_weather","input":{}}}'),
    ("content_block_delta", '{"type":"content_block_delta","index":1,"delta":'
     '{"type":"input_json_delta","partial_json":"{\\"city\\": "}}'),
    ("content_block_delta", '{"type":"content_block_delta","index":1,"delta":'
     '{"type":"input_json_delta","partial_json":"\\"Oslo\\"}"}}'),
    ("content_block_stop", '{"type":"content_block_stop","index":1}'),
    ("message_delta", '{"type":"message_delta","delta":{"stop_reason":"tool_use",'
     '"stop_sequence":null},"usage":{"output_tokens":15}}'),
    ("message_stop", '{"type":"message_stop"}'),
]
CANNED_MESSAGE_STREAM = [f"event: {name}\ndata: {data}\n\n".encode()
                         for name, data in _MESSAGE_EVENTS]

CANNED_RESPONSE = (
    b'{"id":"resp_canned_1","object":"response", "created_at":1700000000,"status":"completed",'
    b'"model":"gpt-canned","output":[{"type":"message","id":"msg_c1","status":"completed",'
    b'"role":"assistant","content":[{"type":"output_text","text":"It is sunny.",'
    b'"annotations":[]}]}],"parallel_tool_calls":true,"tool_choice":"auto","tools":[],\n'
    b'"usage":{"input_tokens":50,"input_tokens_details":{"cached_tokens":40},'
    b'"output_tokens":5,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":55}}'
)
_SHELL = ('"id":"resp_canned_s","object":"response","created_at":1700000001,'
          '"model":"gpt-canned","parallel_tool_calls":true,"tool_choice":"auto","tools":[]')
_TEXT = '{"type":"output_text","text":"It is sunny.","annotations":[]}'
_ITEM = '"type":"message","id":"msg_s1","role":"assistant"'
_USAGE = ('"usage":{"input_tokens":50,"input_tokens_details":{"cached_tokens":40},'
          '"output_tokens":5,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":55}')
_DELTA = ('"item_id":"msg_s1","output_index":0,"content_index":0,"logprobs":[],')
_PART = '"item_id":"msg_s1","output_index":0,"content_index":0,'
_RESPONSE_EVENTS = [
    ("response.created", '{"type":"response.created","sequence_number":0,"response":{'
     + _SHELL + ',"status":"in_progress","output":[]}}'),
    ("response.output_item.added", '{"type":"response.output_item.added",'
     '"sequence_number":1,"output_index":0,"item":{' + _ITEM
     + ',"status":"in_progress","content":[]}}'),
    ("response.content_part.added", '{"type":"response.content_part.added",'
     '"sequence_number":2,' + _PART + '"part":{"type":"output_text","text":"",'
     '"annotations":[]}}'),
    ("response.output_text.delta", '{"type":"response.output_text.delta","sequence_number":3,'
     + _DELTA + '"delta":"It is "}'),
    ("response.output_text.delta", '{"type":"response.output_text.delta","sequence_number":4,'
     + _DELTA + '"delta":"sunny."}'),
    ("response.output_text.done", '{"type":"response.output_text.done","sequence_number":5,'
     + _DELTA + '"text":"It is sunny."}'),
    ("response.content_part.done", '{"type":"response.content_part.done",'
     '"sequence_number":6,' + _PART + '"part":' + _TEXT + '}'),
    ("response.output_item.done", '{"type":"response.output_item.done","sequence_number":7,'
     '"output_index":0,"item":{' + _ITEM + ',"status":"completed","content":[' + _TEXT
     + ']}}'),
    ("response.completed", '{"type":"response.completed","sequence_number":8,"response":{'
     + _SHELL + ',"status":"completed","output":[{' + _ITEM + ',"status":"completed",'
     '"content":[' + _TEXT + ']}],' + _USAGE + '}}'),
]
CANNED_RESPONSE_STREAM = [f"event: {name}\ndata: {data}\n\n".encode()
                          for name, data in _RESPONSE_EVENTS]


def scripted_response(body: dict[str, Any]) -> dict[str, Any]:
    """The scripted agent model's next answer to a Responses request with function tools."""
    tools = [t["name"] for t in body.get("tools") or [] if t.get("type") == "function"]
    items = body["input"] if isinstance(body["input"], list) else []
    outputs = [str(i.get("output")) for i in items if i.get("type") == "function_call_output"]
    number = len(outputs)
    if number < len(tools):
        item: dict[str, Any] = {"type": "function_call", "id": f"fc_script_{number}",
                                "call_id": f"call_script_{number}", "name": tools[number],
                                "arguments": '{"city": "Paris"}', "status": "completed"}
    else:
        item = {"type": "message", "id": f"msg_script_{number}", "status": "completed",
                "role": "assistant", "content": [{"type": "output_text", "annotations": [],
                                                  "text": "Done: " + "; ".join(outputs)}]}
    return {"id": f"resp_script_{number}", "object": "response", "created_at": 1700000100,
            "status": "completed", "model": "gpt-scripted", "output": [item],
            "parallel_tool_calls": False, "tool_choice": "auto", "tools": body.get("tools"),
            "usage": {"input_tokens": 100 + 10 * number,
                      "input_tokens_details": {"cached_tokens": 90 if number else 0},
                      "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": 107 + 10 * number}}


def response_events(response: dict[str, Any]) -> list[bytes]:
    """A Responses object as its SSE events (created, each item added and done, completed)."""
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": {**response, "status": "in_progress", "output": []}})]
    for index, item in enumerate(response["output"]):
        events.append(("response.output_item.added", {"output_index": index, "item": item}))
        if item["type"] == "function_call":
            events.append(("response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": index, "delta": item["arguments"]}))
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
    events.append(("response.completed", {"response": response}))
    return [f"event: {kind}\ndata: ".encode() + json.dumps(
        {"type": kind, "sequence_number": number, **fields}).encode() + b"\n\n"
        for number, (kind, fields) in enumerate(events)]


def _last_user_text(body: dict[str, Any]) -> str | None:
    items = body.get("messages") or body.get("input")
    if isinstance(items, str):
        return items
    for item in reversed(items or []):
        if isinstance(item, dict) and item.get("role") == "user":
            content = item.get("content")
            return content if isinstance(content, str) else None
    return None


class CannedApis(CannedServer):
    """The server (see the module docstring)."""

    def on_post(self, reply: Reply, path: str, data: bytes, number: int) -> None:
        body = json.loads(data)
        hang = _last_user_text(body) == "hang"
        stream = bool(body.get("stream"))
        if path == "/v1/messages":
            if stream:
                reply.stream(CANNED_MESSAGE_STREAM, hang=hang)
            else:
                reply.send(200, CANNED_MESSAGE)
        elif body.get("tools"):
            answer = scripted_response(body)
            if stream:
                reply.stream(response_events(answer), hang=hang)
            else:
                reply.send(200, json.dumps(answer).encode())
        elif stream:
            reply.stream(CANNED_RESPONSE_STREAM, hang=hang)
        else:
            reply.send(200, CANNED_RESPONSE)
