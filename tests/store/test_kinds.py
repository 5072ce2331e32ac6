"""Typed step views own the meta keys of each kind; one parser reads every provider's usage."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtrace.errors import UsageError
from kvtrace.store import (
    HttpExchange,
    ModelCall,
    NoteStep,
    ProviderApi,
    StepKind,
    ToolCall,
    Usage,
    view,
)

PACKAGE = Path(__file__).resolve().parents[2] / "kvtrace"
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _model_call(run, **kwargs):
    defaults = {"model": "gpt-4o", "tools": TOOLS, "params": {"temperature": 0},
                "usage": {"prompt_tokens": 40, "completion_tokens": 7, "cached_tokens": 32},
                "timings": {"total_s": 0.5}, "extra": {"request_model": "gpt-4o-mini"}}
    return run.record_model_call(MESSAGES, "It snows.", **{**defaults, **kwargs})


def test_a_model_call_reads_back_through_its_view(store):
    call = ModelCall(_model_call(store.run("r")))
    assert call.messages == MESSAGES and call.tools == TOOLS
    assert call.response == {"role": "assistant", "content": "It snows."}
    assert (call.model, call.request_model) == ("gpt-4o", "gpt-4o-mini")
    assert call.params == {"temperature": 0} and call.timings == {"total_s": 0.5}
    assert call.usage == Usage(prompt_tokens=40, completion_tokens=7, cached_tokens=32)
    assert call.api is ProviderApi.OPENAI_CHAT and call.edit_of is None
    assert call.output_ids is None and call.http is None and call.is_complete


def test_an_openai_chat_call_records_no_api_key_so_older_steps_keep_their_ids(store):
    step = _model_call(store.run("r"))
    assert "api" not in step.meta
    assert step.meta == ModelCall.meta(model="gpt-4o", params={"temperature": 0},
                                       usage=step.meta["usage"], timings={"total_s": 0.5},
                                       extra={"request_model": "gpt-4o-mini"})


def test_a_model_call_keeps_the_provider_api_it_was_spoken_in(store):
    step = _model_call(store.run("r"), api=ProviderApi.ANTHROPIC_MESSAGES,
                       tools=[{"name": "get_weather", "input_schema": {}}])
    assert ModelCall(step).api is ProviderApi.ANTHROPIC_MESSAGES
    assert step.kind == StepKind.MODEL_CALL and type(step.kind) is str  # stored as plain text


def test_tool_call_and_note_views(store):
    run = store.run("r")
    tool = ToolCall(run.record_tool_call("get_weather", {"city": "Oslo"}, None,
                                         error="timeout", call_id="call_1"))
    assert (tool.tool, tool.arguments, tool.result) == ("get_weather", {"city": "Oslo"}, None)
    assert (tool.error, tool.call_id) == ("timeout", "call_1")
    note = NoteStep(run.record_note("looks wrong", author="supervisor"))
    assert (note.text, note.author) == ("looks wrong", "supervisor")


def test_a_view_of_the_wrong_kind_is_refused(store):
    step = store.run("r").record_note("hello")
    with pytest.raises(UsageError, match="is a note step, not a model_call step"):
        ModelCall(step)


def test_view_picks_the_kind_and_leaves_other_kinds_alone(store):
    run = store.run("r")
    assert isinstance(view(_model_call(run)), ModelCall)
    assert isinstance(view(run.record("http", {"method": "GET", "url": "http://x/",
                                               "status": 204}, meta={"total_s": 0.1})),
                      HttpExchange)
    assert view(run.record("custom_event", {"x": 1})) is None


def test_an_edited_fork_names_the_step_it_copies_and_drops_its_measurements(store):
    original = _model_call(store.run("r"))
    copy = ModelCall(store.fork("r", "r-edit", edit={"response": "It rains."}).head)
    assert copy.edit_of == original.id and copy.response["content"] == "It rains."
    assert copy.usage == Usage() and copy.timings == {}
    assert copy.model == "gpt-4o"  # what the call was stays


@pytest.mark.parametrize(("raw", "expected"), [
    # OpenAI chat completions: cached tokens are inside prompt_tokens.
    ({"prompt_tokens": 100, "completion_tokens": 5,
      "prompt_tokens_details": {"cached_tokens": 64}}, Usage(100, 5, 64)),
    # kvtrace's own records and ATIF keep cached_tokens flat.
    ({"prompt_tokens": 10, "cached_tokens": 0, "finish_reason": "stop"},
     Usage(10, None, 0, finish_reason="stop")),
    # DeepSeek's own names.
    ({"prompt_tokens": 50, "prompt_cache_hit_tokens": 48}, Usage(50, None, 48)),
    # OpenAI Responses: input_tokens includes the cached ones.
    ({"input_tokens": 300, "output_tokens": 9, "input_tokens_details": {"cached_tokens": 256}},
     Usage(300, 9, 256)),
    # Anthropic Messages: input_tokens excludes cache reads and writes.
    ({"input_tokens": 20, "output_tokens": 9, "cache_read_input_tokens": 1000,
      "cache_creation_input_tokens": 200}, Usage(1220, 9, 1000, 200)),
    # A count not sent is unknown, never zero; booleans and strings are not counts.
    ({"completion_tokens": 3}, Usage(None, 3, None)),
    ({"prompt_tokens": True, "cached_tokens": "5"}, Usage()),
    (None, Usage()),
])
def test_usage_parse_knows_each_providers_names(raw, expected):
    assert Usage.parse(raw) == expected


def test_computed_tokens_needs_both_counts():
    assert Usage(100, None, 64).computed_tokens == 36
    assert Usage(100).computed_tokens is None


def _meta_reads(path: Path) -> list[str]:
    """`x.meta.get(...)` and `x.meta[...]` in a module (a step's meta read by key)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr == "get"):
            target = node.func.value
        elif isinstance(node, ast.Subscript):
            target = node.value
        if isinstance(target, ast.Attribute) and target.attr == "meta":
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_nothing_outside_the_views_reads_a_steps_meta_by_key():
    reads = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "kinds.py"
             for hit in _meta_reads(path)]
    assert reads == []


def test_step_kinds_are_compared_with_the_enum_not_a_string():
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "kinds.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            is_step_kind = (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
                            and node.left.attr == "kind")
            if is_step_kind and any(isinstance(c, ast.Constant) and c.value in set(StepKind)
                                    for c in node.comparators):
                spelled.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert spelled == []
