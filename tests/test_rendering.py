"""The one rendering of function-calling conversations (kvtrace/rendering.py)."""

from __future__ import annotations

import json

import pytest

from kvtrace.rendering import (
    assistant_text,
    parse_assistant_text,
    render_tool_call,
    template_messages,
    template_supports_tools,
)

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Facts.",
                                         "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": '{"city": "Paris", "fields": ["country"]}'}}


def test_the_fallback_puts_tools_in_the_system_turn():
    messages, tools = template_messages([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hi"}], [TOOL], native=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n") and "<tools>\n" in system
    assert json.loads(system.split("<tools>\n")[1].split("\n")[0])["function"]["name"] == "lookup"


def test_the_fallback_adds_a_system_turn_for_tools_when_there_is_none():
    messages, _ = template_messages([{"role": "user", "content": "hi"}], [TOOL], native=False)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].startswith("# Tools\n")


def test_the_fallback_renders_tool_calls_and_tool_results_as_text_turns():
    messages, _ = template_messages(
        [{"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"country": "France"}'},
         {"role": "user", "content": [{"type": "text", "text": "and "},
                                      {"type": "text", "text": "Rome?"}]}],
        None, native=False)
    assert messages == [
        {"role": "assistant", "content": '<tool_call>\n{"name": "lookup", "arguments": '
                                         '{"city": "Paris", "fields": ["country"]}}\n</tool_call>'},
        {"role": "tool", "content": '{"country": "France"}'},
        {"role": "user", "content": "and Rome?"},
    ]


def test_tools_render_the_same_whatever_their_key_order():
    reordered = {"function": {"parameters": TOOL["function"]["parameters"],
                              "name": "lookup", "description": "Facts."}, "type": "function"}
    for native in (False, True):
        a = template_messages([{"role": "user", "content": "x"}], [TOOL], native=native)
        b = template_messages([{"role": "user", "content": "x"}], [reordered], native=native)
        assert json.dumps(a) == json.dumps(b)


def test_native_templates_get_arguments_as_objects_and_text_content():
    messages, tools = template_messages(
        [{"role": "assistant", "content": None, "tool_calls": [CALL],
          "reasoning_content": "think"}], [TOOL], native=True)
    assert tools == [json.loads(json.dumps(TOOL, sort_keys=True))]
    (message,) = messages
    assert message["content"] == "" and "reasoning_content" not in message
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Paris",
                                                                 "fields": ["country"]}


def test_a_generated_tool_call_reads_back_and_renders_to_the_same_text():
    text = assistant_text({"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]})
    message = parse_assistant_text(text)
    assert message["content"] == "Let me look."
    assert message["tool_calls"][0]["function"] == CALL["function"]
    assert assistant_text(message) == text
    assert parse_assistant_text(text)["tool_calls"][0]["id"] == message["tool_calls"][0]["id"]


@pytest.mark.parametrize("text", [
    "no tool here",
    "<tool_call>not json</tool_call>",
    '<tool_call>\n["a list"]\n</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
])
def test_text_without_a_well_formed_tool_call_stays_text(text):
    assert parse_assistant_text(text) == {"role": "assistant", "content": text}


def test_lenient_spellings_of_a_tool_call_are_read():
    message = parse_assistant_text('<tool_call>{"name":"lookup","arguments":{"city":"Oslo"}}'
                                   "</tool_call> done")
    assert message["content"] == "done"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert render_tool_call(message["tool_calls"][0]).startswith('<tool_call>\n{"name": "lookup"')


def test_templates_that_know_tools_are_recognised():
    assert template_supports_tools("{% for t in tools %}{{ m.tool_calls }}{% endfor %}")
    assert not template_supports_tools("{{ message['content'] }}")
    assert not template_supports_tools(None)


def test_a_final_block_cut_before_its_closing_tag_is_still_read():
    message = parse_assistant_text('<tool_call>\n{"name": "lookup", "arguments": {"city": "Rome"}}')
    assert message["tool_calls"][0]["function"]["name"] == "lookup"
    assert "tool_calls" not in parse_assistant_text('<tool_call>\n{"name": "lookup", "argu')
    cut = parse_assistant_text('<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_')
    assert cut["tool_calls"][0]["function"] == {"name": "lookup", "arguments": "{}"}
    assert "tool_calls" not in parse_assistant_text('<tool_call>{"name": "x"} trailing</tool_call>')
