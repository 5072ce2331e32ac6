"""ATIF trajectories in and out: each agent step a model call, each linked result a tool call."""

from __future__ import annotations

import json

import pytest

from kvtrace.bench.conversations import tool_calling_conversation
from kvtrace.formats import export_atif, import_atif

V10, V14, V17 = "atif_v1_0_terminal.json", "atif_v1_4_tools.json", "atif_v1_7_parts.json"


@pytest.mark.parametrize("name", [V10, V14, V17])
def test_import_then_export_gives_back_the_document(store, document, name):
    original = document(name)
    import_atif(store, original, run="t")
    assert export_atif(store, "t") == original


def test_agent_steps_are_model_calls_on_the_conversation_so_far(store, document):
    import_atif(store, document(V14), run="shop")
    steps = store.path("shop")
    assert [s.kind for s in steps] == ["model_call", "tool_call", "tool_call", "model_call",
                                       "model_call", "tool_call"]
    first, second, third = (s for s in steps if s.kind == "model_call")
    assert [m["role"] for m in first.content["messages"]] == ["system", "user"]
    assert first.content["messages"][1]["content"].startswith("Where is my order A-1042")
    response = first.content["response"]
    assert response["content"] == "" and response["reasoning_content"].startswith("Two lookups")
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in response["tool_calls"]] == [
        ("call_order_1", "get_order", {"order_id": "A-1042"}),
        ("call_stock_2", "check_stock", {"sku": "MUG-BLUE", "warehouse": "north"})]
    assert first.meta["model"] == "made-up/model-large"
    assert first.meta["usage"] == {"prompt_tokens": 610, "completion_tokens": 41,
                                   "cached_tokens": 512, "cost_usd": 0.0009,
                                   "completion_token_ids": [5, 17, 23, 8]}
    assert second.content["messages"] == [
        *first.content["messages"], response,
        {"role": "tool", "tool_call_id": "call_order_1", "content": steps[1].content["result"]},
        {"role": "tool", "tool_call_id": "call_stock_2", "content": steps[2].content["result"]}]
    assert third.content["messages"][-1] == {"role": "user",
                                             "content": "Tell me when the mug is back, please."}
    assert "completion_token_ids" not in third.meta["usage"]  # the step gave none


def test_observation_results_with_an_id_are_tool_calls(store, document):
    import_atif(store, document(V14), run="shop")
    tool_steps = [s for s in store.path("shop") if s.kind == "tool_call"]
    assert [(s.meta["tool"], s.meta["call_id"], s.content["arguments"]) for s in tool_steps] == [
        ("get_order", "call_order_1", {"order_id": "A-1042"}),
        ("check_stock", "call_stock_2", {"sku": "MUG-BLUE", "warehouse": "north"}),
        ("subscribe_restock", "call_alert_3", {"sku": "MUG-BLUE"})]
    assert tool_steps[2].content["result"] == "subscribed"


def test_terminal_output_without_a_call_id_is_a_user_message(store, document):
    original = document(V10)
    import_atif(store, original, run="term")
    calls = store.path("term")
    assert [s.kind for s in calls] == ["model_call"] * 3  # no tool calls in this trajectory
    assert calls[1].content["messages"][-1] == {
        "role": "user", "content": original["steps"][1]["observation"]["results"][0]["content"]}
    assert calls[0].meta["model"] == "made-up/model-small"  # the agent's default model
    assert [s.meta["usage"]["cached_tokens"] for s in calls] == [0, 384, 448]


def test_content_parts_and_mixed_results_keep_their_order(store, document):
    original = document(V17)
    import_atif(store, original, run="code")
    first, _, _, second, _ = store.path("code")
    assert first.content["messages"][1]["content"] == original["steps"][1]["message"]
    assert first.content["tools"] == original["agent"]["tool_definitions"]
    assert [(m["role"], m.get("tool_call_id")) for m in second.content["messages"][3:]] == [
        ("tool", "c1"), ("user", None), ("tool", "c2")]
    assert second.content["messages"][-1]["content"][1]["type"] == "image"


def test_what_kvtrace_does_not_model_is_kept_under_extra(store, document):
    import_atif(store, document(V17), run="code")
    first = store.path("code")[0]
    kept = first.meta["extra"]["atif"]
    assert kept["root"]["fields"]["trajectory_id"] == "made-up-trajectory-0003"
    assert kept["root"]["fields"]["notes"].startswith("Image paths")
    assert kept["before"][0]["fields"]["observation"]["results"][0]["content"].startswith(
        "workspace reset")
    assert kept["tool_calls"][0]["fields"] == {"extra": {"cached": False}}
    assert kept["step"]["fields"] == {"step_id": 3, "llm_call_count": 1, "extra": {"turn": 1}}


def test_an_edited_tool_result_in_a_fork_is_what_exports(store, document):
    original = document(V14)
    import_atif(store, original, run="shop")
    run = store.fork("shop@1", "shop-edit")
    run.record_tool_call("get_order", {"order_id": "A-1042"}, "not found", call_id="call_order_1")
    exported = export_atif(store, "shop-edit")
    results = exported["steps"][2]["observation"]["results"]
    assert results == [{"source_call_id": "call_order_1", "content": "not found"}]
    assert exported["steps"][:2] == original["steps"][:2]


def test_a_run_recorded_by_kvtrace_exports_and_imports_back_to_the_same_calls(store):
    run = store.run("native")
    for call in tool_calling_conversation(6, seed=3):
        run.record_model_call(call.messages, call.response, model="m", tools=call.tools,
                              usage=call.usage)
        for call_id, name, arguments, result in call.results:
            run.record_tool_call(name, arguments, result, call_id=call_id)
    exported = export_atif(store, "native")
    assert exported["schema_version"] == "ATIF-v1.7"
    assert exported["agent"]["name"] == "kvtrace" and exported["agent"]["model_name"] == "m"
    assert [s["source"] for s in exported["steps"]][:3] == ["system", "user", "agent"]
    assert [s["step_id"] for s in exported["steps"]] == list(range(1, len(exported["steps"]) + 1))
    assert exported["steps"][2]["metrics"]["prompt_tokens"] > 0
    import_atif(store, exported, run="again")
    original = [s for s in store.path("native") if s.kind == "model_call"]
    again = [s for s in store.path("again") if s.kind == "model_call"]
    assert [_gist(s) for s in again] == [_gist(s) for s in original]
    assert [s.meta["usage"] for s in again] == [s.meta["usage"] for s in original]


def _gist(step):
    """What ATIF carries of a model call: roles, text (null is ""), call ids, tool calls, tools.

    (ATIF has no `name` on a tool result and no null message.)
    """
    def message(m):
        calls = [(c["id"], c["function"]["name"], c["function"]["arguments"])
                 for c in m.get("tool_calls", [])]
        return m["role"], m["content"] or "", m.get("tool_call_id"), calls

    content = step.content
    return ([message(m) for m in content["messages"]], message(content["response"]),
            content["tools"])


def test_nulls_empty_lists_and_fields_of_a_later_minor_version_come_back(store, document):
    original = document(V14)
    original["schema_version"] = "ATIF-v1.9"
    original["steps"][3].update(reasoning_content=None, tool_calls=[], observation=None)
    original["steps"][3]["future_field"] = {"added": "in 1.9"}
    original["steps"][5]["tool_calls"][0]["arguments"] = None
    original["steps"][5]["metrics"] = {}
    import_atif(store, original, run="later")
    assert export_atif(store, "later") == original
