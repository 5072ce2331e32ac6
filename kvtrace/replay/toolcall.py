"""The tool-call format of continued runs: plain-text ReAct, parsed leniently.

A model asks for a tool with two lines anywhere in its response:

    Action: calculator
    Action Input: 17*4

and ends the task with ``Final Answer: <answer>``. The tool's result comes
back as a user message ``Observation: <result>``. This format was chosen
because a 135M-parameter instruct model follows it after a few worked
examples (`few_shot_messages`), whereas JSON function calling it does not.
The parser also accepts two common variants small models drift into:
``Action: calculator(17*4)`` on one line, and a JSON object
``{"tool": "calculator", "arguments": ...}`` (also ``name``/``input``/``args``).

`Action Input` is passed to the tool as a JSON value when it parses as one
(an object for keyword-style tools), else as the stripped string. Only the
first action in a response is run: anything the model writes after it (say, an
invented "Observation:") stays in the recorded response but is ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtrace.rendering import tool_result_text
from kvtrace.replay.backend import Message

_ACTION = re.compile(r"^[ \t]*Action[ \t]*:[ \t]*(?P<name>[A-Za-z_][\w.\-]*)(?P<rest>.*)$", re.M)
_INPUT = re.compile(r"^[ \t]*Action[ \t]+Input[ \t]*:[ \t]*(?P<input>.*)$", re.M)
_FINAL = re.compile(r"Final[ \t]+Answer[ \t]*:[ \t]*(?P<answer>.*)", re.S)
_CALL = re.compile(r"^\((?P<args>.*)\)\s*$")
_JSON_KEYS = (("tool", "name"), ("arguments", "args", "input", "parameters"))

OBSERVATION_PREFIX = "Observation: "
NO_ACTION_NUDGE = (
    "Observation: no tool was called. Reply with 'Action: <tool>' and "
    "'Action Input: <input>', or with 'Final Answer: <answer>'."
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool the model asked for, with its (parsed) input."""

    name: str
    arguments: Any


@dataclass(frozen=True, slots=True)
class ParsedResponse:
    """A response read as ReAct: a tool call, a final answer, or neither."""

    call: ToolCall | None
    final_answer: str | None

    @property
    def is_final(self) -> bool:
        return self.call is None and self.final_answer is not None


def parse_response(text: str) -> ParsedResponse:
    """Find the first tool call (or else the final answer) in a model's response."""
    action = _ACTION.search(text)
    final = _FINAL.search(text)
    if action and (final is None or action.start() < final.start()):
        name, rest = action.group("name"), action.group("rest").strip()
        call_args = _CALL.match(rest)
        if call_args:
            return ParsedResponse(ToolCall(name, _value(call_args.group("args"))), None)
        given = _INPUT.search(text, action.end())
        arguments = _value(given.group("input")) if given else ""
        return ParsedResponse(ToolCall(name, arguments), None)
    json_call = _json_call(text)
    if json_call is not None and (final is None or json_call[0] < final.start()):
        return ParsedResponse(json_call[1], None)
    if final:
        return ParsedResponse(None, final.group("answer").strip())
    return ParsedResponse(None, None)


def observation_message(result: Any, error: str | None = None) -> Message:
    """The message that carries a tool's result (or error) back to the model."""
    return {"role": "user", "content": OBSERVATION_PREFIX + tool_result_text(result, error)}


def system_prompt(tools: Mapping[str, str], instructions: str = "") -> str:
    """A system prompt that teaches the format, listing tools by name and description."""
    listing = "\n".join(f"- {name}: {about}" for name, about in tools.items())
    text = (
        "You answer questions by calling tools.\nTools:\n"
        f"{listing}\n"
        "Always reply in this format:\nAction: <tool>\nAction Input: <input>\n"
        "or, once you know the answer:\nFinal Answer: <answer>"
    )
    return f"{text}\n{instructions}" if instructions else text


def few_shot_messages(shots: Sequence[tuple[str, str, str, str, str]]) -> list[Message]:
    """Worked examples as chat turns: (question, tool, input, observation, answer) each."""
    messages: list[Message] = []
    for question, tool, tool_input, observation, answer in shots:
        messages += [
            {"role": "user", "content": f"Question: {question}"},
            {"role": "assistant", "content": f"Action: {tool}\nAction Input: {tool_input}"},
            {"role": "user", "content": OBSERVATION_PREFIX + observation},
            {"role": "assistant", "content": f"Final Answer: {answer}"},
        ]
    return messages


def _value(text: str) -> Any:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'" and text[0] not in text[1:-1]:
        return text[1:-1]
    try:
        return json.loads(text)
    except ValueError:
        return text


def _json_call(text: str) -> tuple[int, ToolCall] | None:
    """The first JSON object in `text` that names a tool, with its offset."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        if not isinstance(value, dict):
            continue
        name = next((value[k] for k in _JSON_KEYS[0] if isinstance(value.get(k), str)), None)
        if name:
            arguments: Any = next((value[k] for k in _JSON_KEYS[1] if k in value), {})
            return match.start(), ToolCall(name, arguments)
    return None
