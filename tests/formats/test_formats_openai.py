"""OpenAI chat messages in and out: tau-bench and mini-swe-agent v2 shaped conversations."""

from __future__ import annotations

import json

import pytest

from kvtrace.apis.chat import normalize_messages
from kvtrace.errors import UsageError
from kvtrace.formats import export_atif, export_openai, import_atif, import_openai
from kvtrace.store import kinds

TAU = "openai_tau_airline.json"
MINI = "openai_mini_swe_agent_v2.json"


def test_each_assistant_turn_is_a_model_call_on_the_conversation_before_it(store, document):
    messages = document(TAU)
    info = import_openai(store, messages, run="tau")
    steps = store.path("tau")
    calls = [s for s in steps if s.kind == "model_call"]
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert info.depth == len(steps) and len(calls) == len(answers) >= 10
    normalized = normalize_messages(messages)
    for call, index in zip(calls, answers, strict=True):
        assert call.content["messages"] == normalized[:index]
        assert call.content["response"] == normalized[index]
        assert call.meta["model"] == "unknown"
    assert calls[0].content["response"]["content"] is None
    assert "function_call" not in calls[0].content["response"]  # null keys are dropped


def test_each_tool_result_is_a_tool_call_linked_by_its_id(store, document):
    messages = document(TAU)
    import_openai(store, messages, run="tau")
    steps = store.path("tau")
    results = {m["tool_call_id"]: m for m in messages if m["role"] == "tool"}
    tool_steps = [s for s in steps if s.kind == "tool_call"]
    assert len(tool_steps) == len(results) >= 5
    for step in tool_steps:
        before = steps[step.depth - 2]  # the model call that asked for it
        call = next(c for c in before.content["response"]["tool_calls"]
                    if c["id"] == step.meta["call_id"])
        assert step.meta["tool"] == call["function"]["name"] == results[call["id"]]["name"]
        assert step.content["arguments"] == json.loads(call["function"]["arguments"])
        assert step.content["result"] == results[call["id"]]["content"]


def test_tau_bench_export_is_the_same_conversation_in_normal_form(store, document):
    messages = document(TAU)
    import_openai(store, messages, run="tau")
    exported = export_openai(store, "tau")
    assert isinstance(exported, list)
    assert exported == normalize_messages(messages)  # only `function_call: null` differs
    assert [m for m in messages if m.get("function_call", 0) is not None] == [
        m for m in exported if m["role"] != "assistant"]


def test_mini_swe_agent_v2_export_is_the_document_itself(store, document):
    original = document(MINI)
    info = import_openai(store, original, run="mini")
    assert info.depth == 20
    exported = export_openai(store, "mini")
    assert exported == original  # info, trajectory_format, per-message extra, the exit message
    assert exported["messages"][-1]["role"] == "exit"


def test_a_tool_result_after_the_last_call_exports_from_its_step(store, document):
    original = document(MINI)
    import_openai(store, original, run="mini")
    last_tool = store.path("mini")[-1]
    assert last_tool.kind == "tool_call" and last_tool.meta["call_id"] == "toolu_09mini"
    run = store.fork("mini~1", "mini-edit")
    run.record_tool_call("bash", {"command": "git diff"}, "edited output", call_id="toolu_09mini")
    exported = export_openai(store, "mini-edit")
    assert exported["messages"][-2] == {**original["messages"][-2], "content": "edited output"}


def test_a_run_recorded_by_kvtrace_exports_and_imports_back_to_the_same_calls(store):
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    run = store.run("native")
    asked = [{"role": "user", "content": "What is 17 * 23?"}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "calc", "arguments": '{"expr": "17 * 23"}'}}
    run.record_model_call(asked, {"role": "assistant", "content": None, "tool_calls": [call]},
                          model="m", tools=tools)
    run.record_tool_call("calc", {"expr": "17 * 23"}, "391", call_id="c1")
    run.record_model_call(
        [*asked, {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c1", "content": "391"}],
        "17 * 23 = 391.", model="m", tools=tools)
    run.record_tool_call("log", {"line": 1}, {"ok": True}, call_id=None)
    exported = export_openai(store, "native")
    assert exported["model"] == "m" and exported["tools"] == tools
    assert exported["messages"][-1] == {"role": "tool", "name": "log", "content": '{"ok": true}'}
    import_openai(store, exported, run="again")
    original = [s for s in store.path("native") if s.kind == "model_call"]
    again = [s for s in store.path("again") if s.kind == "model_call"]
    assert [(s.content, s.meta["model"]) for s in again] == [
        (s.content, s.meta["model"]) for s in original]


def test_an_object_with_model_and_tools_comes_back_whole(store, document):
    messages = normalize_messages(document(TAU))
    tools = [{"type": "function", "function": {"name": "get_reservation_details",
                                               "parameters": {"type": "object"}}}]
    original = {"model": "gpt-4o-2024-08-06", "tools": tools, "messages": messages,
                "task_id": 17, "reward": 1.0}
    import_openai(store, original, run="tau")
    calls = [s for s in store.path("tau") if s.kind == "model_call"]
    assert {s.meta["model"] for s in calls} == {"gpt-4o-2024-08-06"}
    assert all(s.content["tools"] == tools for s in calls)
    assert export_openai(store, "tau") == original


def _steps(store, run):
    """What an export must give back: each step's kind and content, a tool call's name and id."""
    return [(s.kind, s.content, s.meta.get("tool"), s.meta.get("call_id"))
            for s in store.path(run)]


def test_two_tool_calls_with_one_id_are_refused_by_every_path_in(store):
    calls = [{"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}}
             for name in ("f", "g")]
    answered = {"role": "assistant", "content": None, "tool_calls": calls}
    document = [{"role": "user", "content": "go"}, answered,
                {"role": "tool", "tool_call_id": "c1", "content": "r1"},
                {"role": "assistant", "content": "done"}]
    with pytest.raises(UsageError, match=r"^messages\[1\]\.tool_calls\[1\]: id 'c1' is used twice"):
        import_openai(store, document, run="dup")
    with pytest.raises(UsageError, match=r"^response\.tool_calls\[1\]: id 'c1' is used twice"):
        store.run("dup").record_model_call(document[:1], answered, model="m")
    with pytest.raises(UsageError, match=r"^messages\[1\]\.tool_calls\[1\]: id 'c1' is used twice"):
        store.run("dup").record_model_call(document[:3], "done", model="m")
    assert store.path("dup") == []


def test_a_tool_result_answering_no_call_exports_and_imports_back(store):
    # What the server records when a client sends a trimmed conversation.
    run = store.run("served")
    orphan = {"role": "tool", "tool_call_id": "call_gone", "content": "42"}
    prompt = [{"role": "user", "content": "and then?"}, orphan]
    run.record_model_call(prompt, "It was 42.", model="m")
    run.record_tool_call("calc", {"x": 1}, "7", call_id="call_elsewhere")
    exported = export_openai(store, "served")
    assert exported["messages"] == [
        *prompt, {"role": "assistant", "content": "It was 42."},
        {"role": "tool", "tool_call_id": "call_elsewhere", "content": "7"}]
    import_openai(store, exported, run="back")
    assert _steps(store, "back") == _steps(store, "served")[:1]  # no call, so no tool step
    assert export_openai(store, "back") == exported
    atif = export_atif(store, "served")
    import_atif(store, atif, run="back-atif")
    assert [s.kind for s in store.path("back-atif")] == ["model_call"]


def test_a_call_answered_twice_exports_both_answers_in_order(store):
    run = store.run("retried")
    call = {"id": "c1", "type": "function", "function": {"name": "fetch", "arguments": "{}"}}
    asked = [{"role": "user", "content": "fetch it"}]
    run.record_model_call(asked, {"role": "assistant", "content": None, "tool_calls": [call]},
                          model="m")
    run.record_tool_call("fetch", {}, None, call_id="c1", error="timeout")
    run.record_tool_call("fetch", {}, "page", call_id="c1")
    exported = export_openai(store, "retried")
    assert [m.get("content") for m in exported["messages"][2:]] == ["error: timeout", "page"]
    import_openai(store, exported, run="back")
    assert export_openai(store, "back") == exported
    assert [s.content["result"] for s in store.path("back")[1:]] == ["error: timeout", "page"]
    import_atif(store, export_atif(store, "retried"), run="back-atif")
    assert [s.content["result"] for s in store.path("back-atif")[1:]] == [
        "error: timeout", "page"]


def test_arguments_whose_value_cannot_be_stored_are_kept_as_text(store):
    # A model may write anything as arguments; the store keeps them as text (the server does).
    texts = ["[" * 5000 + "]" * 5000, "NaN", "1e400", "[" * 300 + "]" * 300]
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": text}}
             for i, text in enumerate(texts)]
    document = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": calls},
                *({"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls),
                {"role": "assistant", "content": "done"}]
    import_openai(store, document, run="odd")
    assert [s.content["arguments"] for s in store.path("odd")[1:-1]] == texts
    import_openai(store, export_openai(store, "odd"), run="back")
    assert _steps(store, "back") == _steps(store, "odd")
    import_atif(store, export_atif(store, "odd"), run="back-atif")  # ATIF wants objects
    assert [s.content["arguments"] for s in store.path("back-atif")[1:-1]] == [
        {"input": text} for text in texts]


def test_the_server_refuses_two_tool_calls_with_one_id_as_import_does():
    from kvtrace.serve.api import APIError, parse_chat_request

    calls = [{"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}}
             for name in ("f", "g")]
    body = {"model": "m", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"}]}
    with pytest.raises(APIError) as error:
        parse_chat_request(json.dumps(body).encode(), is_local=False)
    assert error.value.status == 400 and error.value.param == "messages"
    assert error.value.message.startswith("messages[1].tool_calls[1]: id 'c1' is used twice")


MINI_DEEPSEEK = "openai_mini_swe_agent_v2_deepseek.json"


def test_mini_swe_agent_v2_calls_take_model_and_usage_from_the_raw_response(store, document):
    original = document(MINI_DEEPSEEK)
    import_openai(store, original, run="ds")
    calls = kinds.model_calls(store.path("ds"))
    raw = [m["extra"]["response"] for m in original["messages"] if m["role"] == "assistant"]
    assert len(calls) == len(raw) == 10
    assert {c.model for c in calls} == {"deepseek-chat"}
    assert [c.raw_usage for c in calls] == [r["usage"] for r in raw]
    assert [c.usage.cached_tokens for c in calls] == [
        r["usage"]["prompt_cache_hit_tokens"] for r in raw]
    assert [c.usage.prompt_tokens for c in calls] == [r["usage"]["prompt_tokens"] for r in raw]
    assert calls[-1].usage.cached_tokens > 0
    assert export_openai(store, "ds") == original  # the raw responses stay on the messages


def test_without_a_raw_response_the_configured_model_names_the_calls(store, document):
    import_openai(store, document(MINI), run="mini")
    calls = kinds.model_calls(store.path("mini"))
    assert {c.model for c in calls} == {"made-up/model-1"} and calls[0].raw_usage == {}


def test_a_raw_response_without_usable_fields_is_left_to_the_document(store, document):
    original = document(MINI_DEEPSEEK)
    for message in original["messages"]:
        if message["role"] == "assistant":
            message["extra"]["response"] = {"model": "", "usage": "lots"}
    import_openai(store, original, run="odd")
    call = kinds.model_calls(store.path("odd"))[0]
    assert call.model == "deepseek/deepseek-chat" and call.raw_usage == {}
    assert export_openai(store, "odd") == original
