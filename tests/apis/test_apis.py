"""Model calls in three APIs: each kept in its own shape, each read as the same chat."""

from __future__ import annotations

import json

import anthropic.types
import openai.types.responses
import pytest

from kvtrace.apis import anthropic as anthropic_shape
from kvtrace.apis import request_params
from kvtrace.apis import responses as responses_shape
from kvtrace.bench.conversations import in_api, tool_calling_conversation
from kvtrace.bench.store import run_conversation_bench
from kvtrace.errors import UsageError
from kvtrace.store import ModelCall, ProviderApi, Usage

SYSTEM = [{"type": "text", "text": "You are a careful assistant.",
           "cache_control": {"type": "ephemeral"}}]
TOOLS = [{"name": "get_weather", "description": "Weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ASKED = [{"role": "user", "content": "Weather in Oslo?"}]
ANSWER = {
    "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
    "content": [
        {"type": "thinking", "thinking": "Look it up.", "signature": "EqQBCkgIARABGAIiQ"},
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Oslo"}},
    ],
    "stop_reason": "tool_use", "stop_sequence": None,
    "usage": {"input_tokens": 12, "cache_creation_input_tokens": 300,
              "cache_read_input_tokens": 2000, "output_tokens": 40},
}
RESULT_TURN = {"role": "user", "content": [
    {"type": "tool_result", "tool_use_id": "toolu_01", "content": "-3 C, snow", "is_error": False},
    {"type": "text", "text": "And tomorrow?"},
]}


def _anthropic_call(run, messages=ASKED, response=ANSWER, **kwargs):
    return run.record_model_call(messages, response, model="claude-sonnet-4-5",
                                 api=ProviderApi.ANTHROPIC_MESSAGES, system=SYSTEM, tools=TOOLS,
                                 usage=ANSWER["usage"], **kwargs)


def test_an_anthropic_call_keeps_its_blocks_and_reads_as_chat(store):
    step = _anthropic_call(store.run("r"))
    call = ModelCall(step)
    assert call.api is ProviderApi.ANTHROPIC_MESSAGES
    native = call.native
    # Kept as sent: thinking with its signature, redacted thinking, cache_control on system.
    assert native["response"]["content"] == ANSWER["content"]
    assert native["response"]["stop_reason"] == "tool_use"
    assert native["system"] == SYSTEM and native["tools"] == TOOLS and native["messages"] == ASKED
    # Read as chat: system first, tool_use as tool_calls, thinking as reasoning_content.
    assert call.messages == [{"role": "system", "content": "You are a careful assistant."},
                             *ASKED]
    assert call.response == {
        "role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.",
        "tool_calls": [{"id": "toolu_01", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]}
    assert call.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city.",
        "parameters": TOOLS[0]["input_schema"]}}]
    # Anthropic's input_tokens excludes cache reads and writes: the prompt is all three.
    assert call.usage == Usage(prompt_tokens=2312, completion_tokens=40, cached_tokens=2000,
                               cache_write_tokens=300)


def test_a_tool_result_turn_reads_as_tool_messages_then_the_user_text(store):
    run = store.run("r")
    _anthropic_call(run)
    step = _anthropic_call(run, messages=[*ASKED, {"role": "assistant",
                                                   "content": ANSWER["content"]}, RESULT_TURN],
                           response={"content": [{"type": "text", "text": "Snow again."}],
                                     "stop_reason": "end_turn"})
    chat = ModelCall(step).messages
    assert chat[-2:] == [{"role": "tool", "tool_call_id": "toolu_01", "content": "-3 C, snow"},
                         {"role": "user", "content": "And tomorrow?"}]
    error_turn = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                               "content": [{"type": "text", "text": "timeout"}],
                                               "is_error": True}]}
    failed = _anthropic_call(store.run("e"), messages=[*ASKED, {
        "role": "assistant", "content": ANSWER["content"]}, error_turn])
    assert ModelCall(failed).messages[-1] == {"role": "tool", "tool_call_id": "toolu_01",
                                              "content": "timeout", "is_error": True}


def test_the_sdks_objects_and_plain_dicts_are_one_step(tmp_path):
    from kvtrace.store import open_store

    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    as_dicts = _anthropic_call(store.run("a"))
    as_objects = store.run("b").record_model_call(
        ASKED, anthropic.types.Message.model_validate(ANSWER), model="claude-sonnet-4-5",
        api="anthropic-messages", system=SYSTEM, tools=TOOLS, usage=ANSWER["usage"])
    # The SDK's model dumps every field (null ones included): normalising makes them one.
    assert as_objects.id == as_dicts.id
    store.close()


@pytest.mark.parametrize(("messages", "message"), [
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}],
     "messages[0].content[0]: tool_result for 'toolu_9' answers no tool_use"),
    ([{"role": "user", "content": [{"type": "text"}]}],
     "messages[0].content[0]: a text block needs text"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}],
     "messages[0].content[0]: a tool_use block needs id"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                         "input": "x"}]}],
     "messages[0].content[0].input must be an object"),
    ([{"role": "system", "content": "hi"}], "messages[0].role is 'system'"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "must be a content block with a type"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list"),
])
def test_malformed_anthropic_messages_are_refused_and_nothing_is_written(store, messages,
                                                                           message):
    run = store.run("r")
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _anthropic_call(run, messages=messages)
    assert run.head is None and store.head("r") is None


def test_a_responses_call_keeps_its_items_and_reads_as_chat(store):
    output = [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text",
                                                         "text": "Need the file."}],
         "encrypted_content": "gAAAAB"},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Reading it.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
         "arguments": "{\"cmd\": \"cat a.txt\"}"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
    ]
    step = store.run("r").record_model_call(
        "Show a.txt", {"id": "resp_1", "output": output, "status": "completed"},
        model="gpt-5", api=ProviderApi.OPENAI_RESPONSES, system="Be brief.",
        tools=[{"type": "function", "name": "shell", "parameters": {"type": "object"}},
               {"type": "web_search"}],
        usage={"input_tokens": 900, "input_tokens_details": {"cached_tokens": 768},
               "output_tokens": 30})
    call = ModelCall(step)
    assert call.native["input"] == [{"type": "message", "role": "user", "content": "Show a.txt"}]
    assert call.native["response"]["output"] == output  # encrypted reasoning kept
    assert call.native["instructions"] == "Be brief."
    assert call.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Show a.txt"}]
    assert call.response["content"] == [{"type": "text", "text": "Reading it."}, output[3]]
    assert call.response["reasoning_content"] == "Need the file."
    assert call.response["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "shell", "arguments": "{\"cmd\": \"cat a.txt\"}"}}]
    assert call.tools == [{"type": "function", "function": {
        "name": "shell", "parameters": {"type": "object"}}}, {"type": "web_search"}]
    # OpenAI counts cached tokens inside input_tokens.
    assert call.usage == Usage(prompt_tokens=900, completion_tokens=30, cached_tokens=768)


def test_responses_tool_outputs_and_custom_tools_read_as_tool_turns(store):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Patch it."}]},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** x"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
    ]
    patched = [{"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Patched."}]}]
    step = store.run("r").record_model_call(items, patched, model="gpt-5", api="openai-responses")
    assert ModelCall(step).messages == [
        {"role": "user", "content": "Patch it."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "apply_patch",
                                                         "arguments": "*** x"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    assert ModelCall(step).response == {"role": "assistant", "content": "Patched."}


def test_a_responses_sdk_object_is_taken_as_it_is(store):
    response = openai.types.responses.Response.model_validate({
        "id": "resp_9", "object": "response", "created_at": 1, "model": "gpt-5",
        "status": "completed", "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "output": [{"type": "message", "id": "m", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]}],
    })
    step = store.run("r").record_model_call("Hello", response, model="gpt-5",
                                            api="openai-responses")
    assert ModelCall(step).response["content"] == "Hi."


@pytest.mark.parametrize(("items", "message"), [
    ([{"type": "function_call_output", "call_id": "c9", "output": "x"}],
     "answers no function call made before it"),
    ([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"a": 1}}],
     "arguments must be a JSON string"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "needs a call_id"),
    ([{"type": "message", "role": "tool", "content": "x"}], "role is 'tool'"),
    ([{"role": ["user"], "content": "x"}], r"role is \['user'\]"),
    ([{"content": "no type, no role"}], "must have a type"),
    (7, "input must be a string or a list"),
])
def test_malformed_responses_input_is_refused_and_nothing_is_written(store, items, message):
    run = store.run("r")
    with pytest.raises(UsageError, match=message):
        run.record_model_call(items, {"output": []}, model="gpt-5", api="openai-responses")
    assert run.head is None and store.head("r") is None


def test_an_unknown_api_or_a_system_prompt_on_a_chat_call_is_refused(store):
    run = store.run("r")
    with pytest.raises(UsageError, match="api is 'gemini'") as caught:
        run.record_model_call(ASKED, "hi", model="m", api="gemini")
    assert caught.value.param == "api"
    with pytest.raises(UsageError, match="system is for Anthropic and Responses") as caught:
        run.record_model_call(ASKED, "hi", model="m", system="Be brief.")
    assert caught.value.param == "system"
    assert run.head is None


def test_a_fork_edits_an_anthropic_response_in_its_own_shape(store):
    run = store.run("r")
    first = _anthropic_call(run)
    fixed = [{"type": "text", "text": "It is -3 C."}]
    fork = store.fork("r@1", "fixed", edit={
        "response": {"content": fixed, "stop_reason": "end_turn"}, "system": "Be terse."})
    edited = ModelCall(fork.head)
    assert edited.native["response"] == {"role": "assistant", "content": fixed,
                                         "stop_reason": "end_turn"}
    assert edited.native["system"] == "Be terse." and edited.native["tools"] == TOOLS
    assert edited.messages[0] == {"role": "system", "content": "Be terse."}
    assert edited.edit_of == first.id
    assert ModelCall(store.show("r")).native["system"] == SYSTEM  # the original is untouched
    with pytest.raises(UsageError, match="a tool_use block needs id"):
        store.fork("r", "bad", edit={"response": [{"type": "tool_use", "name": "f"}]})
    with pytest.raises(UsageError, match="has no field 'instructions'"):
        store.fork("r", "bad", edit={"instructions": "x"})


@pytest.mark.parametrize("api", [ProviderApi.ANTHROPIC_MESSAGES, ProviderApi.OPENAI_RESPONSES])
def test_from_chat_and_back_is_the_same_conversation(api):
    """The inverse mappings (used by the server and the benchmark) lose nothing chat says."""
    module = anthropic_shape if api is ProviderApi.ANTHROPIC_MESSAGES else responses_shape
    calls = tool_calling_conversation(20, seed=3)
    for call, spoken in zip(calls, in_api(calls, api), strict=True):
        assert module.to_chat(spoken.system, spoken.messages) == [
            {k: v for k, v in m.items() if k != "name"} for m in call.messages]
        back = module.chat_response(spoken.response)
        assert back == call.response


@pytest.mark.parametrize("api", list(ProviderApi))
def test_a_60_call_conversation_is_stored_near_its_distinct_bytes(store_url, api):
    """Per-message dedup holds in every API (bench store reports the same figure)."""
    figures = run_conversation_bench(store_url, with_tool_steps=False, api=api)
    assert figures["api"] == api.value
    assert figures["store_bytes_over_distinct"] <= 1.5, figures
    # Without item-by-item lists the history would be stored again at every call.
    assert figures["store_bytes"] * 10 < figures["one_blob_per_call_bytes"]


@pytest.mark.parametrize(("api", "conversation"), [
    (ProviderApi.OPENAI_CHAT, {"messages": []}),
    (ProviderApi.ANTHROPIC_MESSAGES, {"messages": [], "system": "Be brief."}),
    (ProviderApi.OPENAI_RESPONSES, {"input": [], "instructions": "Be brief."}),
])
def test_one_list_of_parameters_per_api_leaves_out_streaming(api, conversation):
    request = {**conversation, "model": "m", "tools": [], "stream": True,
               "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.9}
    assert request_params(api, request) == {"temperature": 0.5, "top_p": 0.9}


def test_arguments_that_spell_no_object_are_kept_as_text_in_a_tool_use():
    blocks = anthropic_shape.blocks_of({"role": "assistant", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{not json"}},
        {"id": "c", "type": "function", "function": {"name": "h", "arguments": ""}}]})
    assert [b.get("input") for b in blocks] == [
        None, {"arguments": "[1, 2]"}, {"arguments": "{not json"}, {}]
