"""The ReAct tool-call format of continued runs, parsed leniently."""

from __future__ import annotations

from kvtrace.replay.toolcall import observation_message, parse_response


def test_two_line_action_with_plain_input():
    parsed = parse_response("Thought: add them\nAction: calculator\nAction Input: 17*4\n")
    assert parsed.call is not None
    assert (parsed.call.name, parsed.call.arguments) == ("calculator", "17*4")


def test_action_input_that_is_json_is_decoded():
    parsed = parse_response('Action: lookup\nAction Input: {"city": "Rome"}')
    assert parsed.call is not None and parsed.call.arguments == {"city": "Rome"}


def test_one_line_call_variant():
    parsed = parse_response("Action: calculator(3*5)")
    assert parsed.call is not None and parsed.call.arguments == "3*5"


def test_json_object_variant():
    parsed = parse_response('I will call {"tool": "lookup", "arguments": "Paris"} now')
    assert parsed.call is not None and (parsed.call.name, parsed.call.arguments) == (
        "lookup",
        "Paris",
    )


def test_only_the_first_action_counts_and_invented_observations_are_ignored():
    text = "Action: lookup\nAction Input: Rome\nObservation: 5\nAction: calculator\nAction Input: 1"
    parsed = parse_response(text)
    assert parsed.call is not None and parsed.call.name == "lookup"


def test_final_answer_ends_the_task():
    parsed = parse_response("Final Answer: 68")
    assert parsed.is_final and parsed.final_answer == "68" and parsed.call is None


def test_plain_text_is_neither_call_nor_answer():
    parsed = parse_response("I am not sure.")
    assert parsed.call is None and parsed.final_answer is None and not parsed.is_final


def test_observation_renders_results_and_errors():
    assert observation_message(68)["content"] == "Observation: 68"
    assert observation_message({"b": 1, "a": 2})["content"] == 'Observation: {"a": 2, "b": 1}'
    assert observation_message(None, "ValueError: bad")["content"] == (
        "Observation: error: ValueError: bad"
    )
