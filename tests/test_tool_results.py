"""One rule turns a tool result into prompt text, whichever path writes the message.

Continue (a `tool` message), the ReAct loop (an ``Observation:``), import and
export (OpenAI messages, ATIF observations) and the chat rendering every
engine path uses must give the same bytes for the same result: a prompt
rendered two ways is a cache miss, or a replay that is not the recording.
"""

from __future__ import annotations

import pytest

from kvtrace.formats import export_document, import_document
from kvtrace.rendering import content_text, template_messages, tool_result_content, tool_result_text
from kvtrace.replay.continuation import conversation_at, tool_message
from kvtrace.replay.toolcall import OBSERVATION_PREFIX, observation_message
from kvtrace.store.kinds import model_calls

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
RESULTS = [
    pytest.param("plain text", None, id="text"),
    pytest.param({"zeta": 1, "alpha": [2, {"b": 1, "a": 0}]}, None, id="unsorted-dict"),
    pytest.param([{"type": "text", "text": "part one"}, {"type": "text", "text": " two"}], None,
                 id="content-parts"),
    pytest.param(42.5, None, id="number"),
    pytest.param("ignored", "ValueError: bad input", id="error"),
]


@pytest.mark.parametrize(("result", "error"), RESULTS)
def test_every_path_gives_the_same_prompt_text(store, result, error):
    expected = tool_result_text(result, error)
    run = store.run("r")
    run.record_model_call([{"role": "user", "content": "go"}],
                          {"role": "assistant", "content": None, "tool_calls": [CALL]},
                          model="m", tools=[{"type": "function", "function": {"name": "lookup"}}])
    run.record_tool_call("lookup", {"q": "x"}, result, error=error, call_id="call_1")

    continued = tool_message("call_1", "lookup", result, error)
    from_trace = conversation_at(store.path("r")).messages[-1]
    observation = observation_message(result, error)["content"]
    exported = export_document(store, "r", format="openai")
    exported_tool = exported["messages"][-1] if isinstance(exported, dict) else exported[-1]
    rendered, _ = template_messages([continued], None, native=False)

    assert from_trace == continued
    assert content_text(continued["content"]) == expected
    assert observation == OBSERVATION_PREFIX + expected
    assert exported_tool["content"] == tool_result_content(result, error)
    assert rendered[0]["content"] == expected


def test_a_result_exported_and_imported_renders_to_the_same_bytes(store):
    run = store.run("r")
    run.record_model_call([{"role": "user", "content": "go"}],
                          {"role": "assistant", "content": None, "tool_calls": [CALL]},
                          model="m", tools=[{"type": "function", "function": {"name": "lookup"}}])
    run.record_tool_call("lookup", {"q": "x"}, {"b": 2, "a": 1}, call_id="call_1")
    run.record_model_call([{"role": "user", "content": "go"},
                           {"role": "assistant", "content": None, "tool_calls": [CALL]},
                           tool_message("call_1", "lookup", {"b": 2, "a": 1})],
                          "done", model="m",
                          tools=[{"type": "function", "function": {"name": "lookup"}}])
    document = export_document(store, "r", format="openai")
    import_document(store, document, format="openai", run="back")
    original = conversation_at(store.path("r")[:2]).messages
    imported = model_calls(store.path("back"))[-1].messages
    assert original == imported
