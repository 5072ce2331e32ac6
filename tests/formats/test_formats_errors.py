"""A bad document is one UsageError naming its first offending element, and writes nothing."""

from __future__ import annotations

import pytest

from kvtrace.errors import UsageError
from kvtrace.formats import import_atif, import_openai
from kvtrace.formats.records import parse_json
from kvtrace.store.objects.encoding import MAX_DEPTH
from tests.formats.conftest import state


def _atif(document, change):
    doc = document("atif_v1_4_tools.json")
    change(doc)
    return doc


ATIF_CASES = {
    "unknown major version": (
        lambda d: d.update(schema_version="ATIF-v2.0"),
        "schema_version is 'ATIF-v2.0': kvtrace reads ATIF-v1.0 to ATIF-v1.7"),
    "no version": (lambda d: d.pop("schema_version"), "schema_version: missing"),
    "version not ATIF": (lambda d: d.update(schema_version="1.4"), "expected \"ATIF-v1.N\""),
    "missing function_name": (
        lambda d: d["steps"][2]["tool_calls"][0].pop("function_name"),
        "steps[2].tool_calls[0]: missing function_name"),
    "arguments not an object": (
        lambda d: d["steps"][2]["tool_calls"][1].update(arguments="sku=MUG"),
        "steps[2].tool_calls[1].arguments must be an object"),
    "result matching no call": (
        lambda d: d["steps"][5]["observation"]["results"][0].update(source_call_id="call_x"),
        "steps[5].observation.results[0]: source_call_id 'call_x' matches no tool call"),
    "unknown source": (
        lambda d: d["steps"][1].update(source="bot"), "steps[1].source is 'bot'"),
    "missing message": (lambda d: d["steps"][3].pop("message"), "steps[3].message: missing"),
    "token count as text": (
        lambda d: d["steps"][3]["metrics"].update(prompt_tokens="702"),
        "steps[3].metrics.prompt_tokens must be a whole number"),
    "no agent step": (
        lambda d: d.update(steps=d["steps"][:2]), "steps: no agent step"),
    "steps not a list": (lambda d: d.update(steps={}), "steps: missing"),
    "NaN": (lambda d: d["steps"][3]["metrics"].update(cost_usd=float("nan")),
            "the document cannot be stored"),
}


@pytest.mark.parametrize("case", sorted(ATIF_CASES))
def test_a_bad_atif_document_names_the_element_and_writes_nothing(store, document, case):
    change, message = ATIF_CASES[case]
    before = state(store)
    with pytest.raises(UsageError) as error:
        import_atif(store, _atif(document, change), run="bad")
    assert message in str(error.value) and "\n" not in str(error.value)
    assert state(store) == before


def test_an_atif_list_is_not_a_trajectory(store):
    with pytest.raises(UsageError, match="an ATIF document is a JSON object"):
        import_atif(store, [], run="bad")
    assert store.runs() == []


def _second_call_with_the_same_id(messages):
    first = messages[2]["tool_calls"][0]
    messages[2]["tool_calls"].append(
        {**first, "function": {"name": "other_tool", "arguments": "{}"}})


def _only_user_turns_and_a_number(messages):
    messages[:] = [{"role": "user", "content": 5}]


OPENAI_CASES = {
    "two tool calls with one id": (
        _second_call_with_the_same_id,
        "messages[2].tool_calls[1]: id 'call_7_000' is used twice in this message"),
    "content a number": (
        lambda m: m[1].update(content=5),
        "messages[1].content must be a string, null or a list of content parts"),
    "content a number, no assistant": (
        _only_user_turns_and_a_number,
        "messages[0].content must be a string, null or a list of content parts"),
    "content a number after the last answer": (
        lambda m: m.append({"role": "user", "content": 5}),
        "messages[26].content must be a string, null or a list of content parts"),
    "tool_call_id a number": (
        lambda m: m[3].update(tool_call_id=3), "messages[3].tool_call_id must be a string"),
    "message without a role": (lambda m: m[1].pop("role"), "messages[1] is not a chat message"),
    "unknown role in a prompt": (
        lambda m: m[1].update(role="robot"), "messages[1].role is 'robot'"),
    "bad tool call": (
        lambda m: m[2]["tool_calls"][0].pop("function"),
        "messages[2].tool_calls[0].function needs a name"),
    "no assistant": (
        lambda m: [x.update(role="user") for x in m if x["role"] != "system"],
        "messages: no assistant message"),
}


@pytest.mark.parametrize("case", sorted(OPENAI_CASES))
def test_a_bad_openai_document_names_the_element_and_writes_nothing(store, document, case):
    change, message = OPENAI_CASES[case]
    messages = document("openai_tau_airline.json")
    change(messages)
    before = state(store)
    with pytest.raises(UsageError) as error:
        import_openai(store, messages, run="bad")
    assert message in str(error.value) and "\n" not in str(error.value)
    assert state(store) == before


def test_an_object_without_messages_is_refused(store):
    with pytest.raises(UsageError, match="messages: missing"):
        import_openai(store, {"conversation": []}, run="bad")


def test_importing_onto_a_run_with_steps_is_refused_and_onto_an_empty_one_works(store, document):
    import_openai(store, document("openai_tau_airline.json"), run="tau")
    before = state(store)
    with pytest.raises(UsageError, match="run 'tau' exists with 22 steps"):
        import_atif(store, document("atif_v1_0_terminal.json"), run="tau")
    assert state(store) == before
    store.run("empty")
    info = import_atif(store, document("atif_v1_0_terminal.json"), run="empty")
    assert info.depth == 3


def test_a_document_nests_as_deep_as_the_store_holds_and_no_deeper():
    assert parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, "f.json") is not None
    for depth in (MAX_DEPTH + 1, 5000, 100_000):
        with pytest.raises(UsageError, match=r"^f\.json is nested more than 256 levels deep$"):
            parse_json("[" * depth + "]" * depth, "f.json")


def test_an_integer_past_the_parsers_digit_limit_is_a_usage_error():
    assert parse_json("[" + "9" * 4000 + "]", "f.json") == [int("9" * 4000)]
    with pytest.raises(UsageError, match=r"^f\.json holds a number of more than 4300 digits"):
        parse_json("[" + "9" * 5000 + "]", "f.json")
