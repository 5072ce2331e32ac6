"""Function-calling conversations as a chat template sees them, and back.

One rule for every path (replay, analyze, continue, the server): a model call
is rendered from its (messages, tools) by `template_messages`, then by the model's
chat template. Two cases:

- **Native**: the template itself renders `tools`, `tool_calls` and `tool`
  turns (it mentions ``tool_calls`` and ``tools``; Qwen2.5, Llama 3.1 and
  Hermes-style templates do). Messages go to it as OpenAI shapes, with
  tool-call arguments parsed from their JSON string into an object (what
  transformers' templates expect) and content parts joined into text.
- **Fallback**, for templates that read only ``role`` and ``content`` (the
  default SmolLM2 template): one deterministic rendering in the Hermes
  style. The tool definitions go at the end of the system turn (a system turn
  is added in front when there is none)::

      # Tools
      You may call one or more functions. Function signatures:
      <tools>
      {"function": {...}, "type": "function"}      (one JSON line per tool, keys sorted)
      </tools>
      To call a function, reply with a JSON object inside <tool_call></tool_call>:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  an assistant turn's tool calls follow its text, one block each::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  and a tool result is a turn of role ``tool`` whose content is the result.
  `reasoning_content` is not rendered (templates drop earlier reasoning
  too); non-text content parts (images) are not rendered (the engine is
  text-only).

`assistant_text` is what a model says for an assistant message in the
fallback (and Hermes) rendering; `parse_assistant_text` reads a generated
text back into an assistant message, so a tool call a model generates is
recorded as `tool_calls`, and re-rendered, gives the same text when it was
written canonically (one space after ``:`` and ``,``, as `json.dumps` writes).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# A block; the last one may lack its closing tag (a generation cut at its token limit).
_BLOCK = re.compile(r"<tool_call>\s*(?P<body>.*?)\s*(?:</tool_call>|\Z)", re.S)
_TOOLS_HEADER = (
    "# Tools\nYou may call one or more functions. Function signatures:\n<tools>\n"
)
_TOOLS_FOOTER = (
    "</tools>\nTo call a function, reply with a JSON object inside <tool_call></tool_call>:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def template_supports_tools(template: Any) -> bool:
    """Whether a chat template renders tools and tool calls itself."""
    text = template if isinstance(template, str) else json.dumps(template, default=str)
    return "tool_calls" in text and "tools" in text


def template_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    native: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand to the chat template (see the module docstring)."""
    # Tools are rendered with sorted keys: the store keeps JSON canonically
    # (sorted), so a live request and its recording must render alike.
    listed: list[dict[str, Any]] | None = [_sorted(t) for t in tools] if tools else None
    if native:
        return [_native_message(m) for m in messages], listed
    plain = [
        {"role": str(m.get("role", "user")), "content": assistant_text(m)
         if m.get("role") == "assistant" else content_text(m.get("content"))}
        for m in messages
    ]
    if listed:
        listing = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in listed)
        block = _TOOLS_HEADER + listing + _TOOLS_FOOTER
        if plain and plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{block}"}
        else:
            plain.insert(0, {"role": "system", "content": block})
    return plain, None


def content_text(content: Any) -> str:
    """The text of a message's content (a string, null, or a list of content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) for part in content
            if isinstance(part, Mapping) and part.get("type") in ("text", "input_text", None)
        )
    return str(content)


def tool_result_content(result: Any, error: str | None = None) -> Any:
    """How a tool's result (or error) is written into the conversation: the one rule.

    Every path that turns a recorded tool call into a message uses this (continue,
    the ReAct observation, import and export, the server), because a prompt
    rendered two ways is a cache miss, or a wrong replay. An error is
    ``"error: …"``; text stays as it is; a list of content parts stays a list
    (a message may carry parts); anything else is JSON with sorted keys, so
    equal results give equal bytes whatever their key order. None stays None
    (a message with no content).
    """
    if error is not None:
        return f"error: {error}"
    if result is None or isinstance(result, str):
        return result
    if isinstance(result, list) and result and all(
            isinstance(part, Mapping) and isinstance(part.get("type"), str) for part in result):
        return [dict(part) for part in result]
    return json.dumps(result, ensure_ascii=False, sort_keys=True)


def tool_result_text(result: Any, error: str | None = None) -> str:
    """`tool_result_content` as plain text (content parts joined, None as "")."""
    return content_text(tool_result_content(result, error))


def assistant_text(message: Mapping[str, Any] | str) -> str:
    """What the model says for an assistant message: its text, then one block per tool call."""
    if isinstance(message, str):
        return message
    text = content_text(message.get("content"))
    blocks = [render_tool_call(call) for call in message.get("tool_calls") or []]
    if not blocks:
        return text
    return "\n".join([text, *blocks]) if text else "\n".join(blocks)


def render_tool_call(call: Mapping[str, Any]) -> str:
    """One tool call as a ``<tool_call>`` block, arguments as a JSON object when they parse."""
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": parse_arguments(function.get("arguments"))}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def id_seed(messages: Sequence[Mapping[str, Any]]) -> str:
    """What tool-call ids of a response to `messages` derive from: the conversation.

    Every path that reads generated tool calls (the server, continue, branch)
    seeds with it, so the same call in two turns of a conversation gets two
    ids, and the same generation for the same conversation the same id.
    """
    text = json.dumps([dict(m) for m in messages], sort_keys=True, ensure_ascii=False,
                      default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def parse_assistant_text(text: str, *, id_seed: str = "") -> dict[str, Any]:
    """A generated text as an assistant message, its ``<tool_call>`` blocks as `tool_calls`.

    A block that is not a JSON object with a string ``name`` stays part of the
    text. Tool-call ids are derived from `id_seed`, the text and the position,
    so the same generation always gets the same ids.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        body = _block_json(match.group("body"))
        if body is None:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        kept.append(text[last : match.start()])
        last = match.end()
        digest = hashlib.sha256(f"{id_seed}\x00{text}\x00{len(calls)}".encode()).hexdigest()
        calls.append({
            "id": f"call_{digest[:24]}",
            "type": "function",
            "function": {
                "name": body["name"],
                "arguments": arguments if isinstance(arguments, str)
                else json.dumps(arguments, ensure_ascii=False),
            },
        })
    if not calls:
        return {"role": "assistant", "content": text}
    kept.append(text[last:])
    content = "".join(kept).strip()
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def _block_json(body: str) -> Any:
    """The JSON value of a block's body; an unclosed last block may end in part of its tag."""
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    rest = body[end:].strip()
    return value if not rest or TOOL_CALL_CLOSE.startswith(rest) else None


def _sorted(value: Any) -> Any:
    """`value` with every mapping's keys in sorted order (a deep copy)."""
    if isinstance(value, Mapping):
        return {key: _sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted(item) for item in value]
    return value


def parse_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a JSON value: the string parsed (kept as text when it is
    not JSON), null as an empty object, anything else as it is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return arguments
    return {} if arguments is None else arguments


def _native_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    if not isinstance(out.get("content"), str):  # parts joined; null as "" (templates concatenate)
        out["content"] = content_text(out.get("content"))
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {**(call.get("function") or {}),
                                  "arguments": parse_arguments((call.get("function") or {})
                                                          .get("arguments"))}}
            for call in out["tool_calls"]
        ]
    return out
