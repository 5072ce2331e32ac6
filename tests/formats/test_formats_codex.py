"""Codex rollouts in and out: Responses calls, tool outputs, token_count usage, the file back."""

from __future__ import annotations

import io
import itertools
import json

import pytest

from kvtrace.errors import UsageError
from kvtrace.formats import codex_records, export_codex, import_codex, import_file
from kvtrace.formats.records import ModelCallRecord
from kvtrace.store import ProviderApi, Usage, kinds
from tests.formats.conftest import DATA, state

ROLLOUT = next((DATA / "codex").glob("rollout-*.jsonl"))


def _lines(path=ROLLOUT):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _import(store, run="cx", data=None):
    data = data if data is not None else ROLLOUT.read_bytes()
    return import_file(store, io.BytesIO(data), format="codex", run=run, filename=ROLLOUT.name)


def _usages(lines):
    return [line["payload"]["info"]["last_token_usage"] for line in lines
            if line["type"] == "event_msg" and line["payload"]["type"] == "token_count"
            and line["payload"]["info"]]


def test_each_model_response_is_one_responses_call_with_its_usage(store):
    _import(store)
    calls = kinds.model_calls(store.path("cx"))
    lines = _lines()
    assert len(calls) == len(_usages(lines)) == 12
    assert all(c.api is ProviderApi.OPENAI_RESPONSES for c in calls)
    assert [c.raw_usage for c in calls] == _usages(lines)
    assert {c.model for c in calls} == {"gpt-5.1-codex"}
    instructions = lines[0]["payload"]["base_instructions"]["text"]
    assert all(c.native["instructions"] == instructions for c in calls)
    first = calls[0].native
    assert [(i["type"], i.get("role")) for i in first["input"]] == [
        ("message", "developer"), ("message", "user"), ("message", "user")]
    assert [i["type"] for i in first["response"]["output"]] == ["reasoning", "function_call"]
    assert first["response"]["output"][0]["encrypted_content"].startswith("gAAAA")
    # Two function calls in one response: one call, both outputs in the next input.
    assert [i["type"] for i in calls[1].native["response"]["output"]] == [
        "reasoning", "function_call", "function_call"]
    assert [i["type"] for i in calls[2].native["input"][-2:]] == [
        "function_call_output", "function_call_output"]


def test_each_input_extends_the_previous_call_and_its_output(store):
    _import(store)
    calls = kinds.model_calls(store.path("cx"))
    for before, call in itertools.pairwise(calls):
        sent = [*before.native["input"], *before.native["response"]["output"]]
        assert call.native["input"][: len(sent)] == sent


def test_codex_usage_counts_cached_tokens_inside_the_input(store):
    _import(store)
    usage = kinds.model_calls(store.path("cx"))[3].usage
    raw = kinds.model_calls(store.path("cx"))[3].raw_usage
    assert usage == Usage(raw["input_tokens"], raw["output_tokens"], raw["cached_input_tokens"])
    assert 0 < usage.cached_tokens < usage.prompt_tokens
    assert Usage.parse({"input_tokens": 10, "cached_input_tokens": 4,
                        "cache_write_input_tokens": 6}).cache_write_tokens == 6


def test_each_tool_output_is_a_tool_call_after_its_call(store):
    _import(store)
    path = store.path("cx")
    tools = kinds.tool_calls(path)
    outputs = [line["payload"] for line in _lines() if line["type"] == "response_item"
               and line["payload"]["type"].endswith("_output")]
    assert len(tools) == len(outputs) == 11
    assert [t.call_id for t in tools] == [o["call_id"] for o in outputs]
    assert [t.result for t in tools] == [o["output"] for o in outputs]
    shell = tools[0]
    assert shell.tool == "shell_command" and shell.arguments["command"].startswith("rg -n")
    patch = next(t for t in tools if t.tool == "apply_patch")
    assert patch.arguments.startswith("*** Begin Patch")  # a custom tool's free-form input
    for tool in tools:  # after the call that made it, before the next
        asked = [c for c in kinds.model_calls(path) if c.step.depth < tool.step.depth][-1]
        made = {i.get("call_id") for i in asked.native["response"]["output"]}
        assert tool.call_id in made


def test_export_gives_back_the_rollout_and_its_import_the_same_steps(store):
    _import(store)
    lines = export_codex(store, "cx")
    assert lines == _lines()
    import_codex(store, lines, run="again")
    assert [s.id for s in store.path("again")] == [s.id for s in store.path("cx")]


def test_a_fork_with_an_edited_output_exports_the_edit(store):
    _import(store)
    tool = kinds.tool_calls(store.path("cx"))[4]
    store.fork(f"cx@{tool.step.depth}", "cx-edit", edit={"result": "Exit code: 1\n"})
    lines = export_codex(store, "cx-edit")
    outputs = [line["payload"] for line in lines if line["type"] == "response_item"
               and line["payload"]["type"] == "function_call_output"]
    assert outputs[-1] == {"type": "function_call_output", "call_id": tool.call_id,
                           "output": "Exit code: 1\n"}  # where the original was
    assert lines[-1]["payload"]["type"] == "token_count"  # the call's own lines go on
    back = codex_records(lines)
    assert back[-1].result == "Exit code: 1\n"


def test_compacted_history_is_what_the_next_call_sends(store):
    lines = _lines()[:40]
    summary = {"type": "message", "role": "user",
               "content": [{"type": "input_text", "text": "Summary: the health check fix."}]}
    lines.append({"timestamp": "2026-11-20T11:00:00.000Z", "type": "compacted",
                  "payload": {"message": "Summary", "replacement_history": [summary]}})
    lines.append({"timestamp": "2026-11-20T11:00:01.000Z", "type": "response_item",
                  "payload": {"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": "Continuing."}]}})
    records = codex_records(lines)
    last = [r for r in records if isinstance(r, ModelCallRecord)][-1]
    assert last.messages == [summary] and last.usage is None
    # Without replacement_history (older Codex): the user messages, then the summary.
    lines[-2]["payload"] = {"message": "Summary of the work."}
    last = [r for r in codex_records(lines) if isinstance(r, ModelCallRecord)][-1]
    assert [m["role"] for m in last.messages] == ["developer", "user", "user", "user"]
    assert last.messages[-1]["content"][0]["text"] == "Summary of the work."


def test_usage_from_running_totals_when_the_last_request_is_not_given():
    lines = _lines()
    for line in lines:
        if line["type"] == "event_msg" and line["payload"]["type"] == "token_count" and (
                line["payload"]["info"]):
            del line["payload"]["info"]["last_token_usage"]
    calls = [r for r in codex_records(lines) if isinstance(r, ModelCallRecord)]
    assert [c.usage for c in calls] == _usages(_lines())


def _with(change):
    lines = ROLLOUT.read_text().splitlines(keepends=True)
    return "".join(change(lines)).encode()


def _first_output(lines):
    return next(i for i, line in enumerate(lines) if '"function_call_output"' in line)


@pytest.mark.parametrize(("change", "message"), [
    (lambda ls: [*ls[:-1], ls[-1][:30]], r"line 63 is not JSON: .*\(a truncated line\?\)"),
    (lambda ls: [*ls[:3], "{\"type\": \"response_item\", \"payload\": 7}\n", *ls[3:]],
     r"line 4: a response_item's payload must be a Responses item"),
    (lambda ls: [*ls[:_first_output(ls)],
                 ls[_first_output(ls)].replace('"call_h01"', '"call_zz"'),
                 *ls[_first_output(ls) + 1:]],
     r"line \d+: function_call_output for 'call_zz' answers no call an earlier line made"),
    (lambda ls: [ls[0]], r"has no item a model produced"),
])
def test_a_bad_rollout_is_one_error_naming_its_line_and_writes_nothing(store, change, message):
    before = state(store)
    with pytest.raises(UsageError, match=message):
        _import(store, "bad", _with(change))
    assert state(store) == before
