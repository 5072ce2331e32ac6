"""compare(): the first step whose content differs between two runs, field by field."""

from __future__ import annotations

import pytest

from kvtrace.errors import NotFoundError
from kvtrace.store.present.compare import compare
from tests.agent_runs import ask, call, record_answer, record_calc_run


@pytest.fixture
def main(store):
    record_calc_run(store.run("main"))
    return store


def test_a_fork_with_an_edited_tool_result_names_that_step_and_shows_both_results(main):
    fork = main.fork("main@1", "fixed")
    record_answer(fork, "What is 17 * 23?", call("17 * 23"), "392")
    result = compare(main, "main", "fixed")
    assert result.is_related and result.divergence.common.depth == 1
    assert result.position == 2
    assert result.step_b.id == main.show("fixed@2").id and result.step_b.kind == "tool_call"
    assert [c.field for c in result.changes] == ["result"]
    change = result.changes[0]
    assert (change.a, change.b) == ("391", "392")
    assert "-391" in change.diff and "+392" in change.diff


def test_a_fork_with_an_edited_user_message_shows_the_message_diff(main):
    fork = main.fork("main@2", "reworded")
    asked = call("17 * 23")
    tool_message = {"role": "tool", "tool_call_id": "call_1", "content": "391"}
    fork.record_model_call([*ask("What is 17 times 23, exactly?"), asked, tool_message],
                           "The answer is 391.", model="gpt-4o")
    result = compare(main, "main", "reworded")
    assert result.position == 3 and result.step_a.id == main.show("main@3").id
    fields = [c.field for c in result.changes]
    assert fields == ["messages[1] (user)", "tools"]  # the fork also left the tools out
    diff = result.changes[0].diff
    assert "-What is 17 * 23?" in diff and "+What is 17 times 23, exactly?" in diff


def test_unrelated_runs_are_aligned_from_the_root_and_show_edited_tool_call_arguments(main):
    record_calc_run(main.run("other"), expr="17 * 24")
    result = compare(main, "main", "other")
    assert not result.is_related and result.divergence.common is None
    assert result.position == 1
    change = next(c for c in result.changes if c.field == "response.tool_calls[0]")
    assert '-  "expr": "17 * 23"' in change.diff and '+  "expr": "17 * 24"' in change.diff
    assert change.b.startswith("call calc (id call_1)")


def test_steps_that_differ_only_in_usage_are_skipped_to_the_first_content_change(main):
    other = main.run("other")
    record_calc_run(other, result="390", usage={"prompt_tokens": 53})
    result = compare(main, "main", "other")
    assert not result.is_related  # the root steps' ids differ (usage is hashed) ...
    assert result.num_same_content == 1  # ... but not their content
    assert result.position == 2 and [c.field for c in result.changes] == ["result"]


def test_a_run_that_ends_first_has_no_step_at_the_first_difference(main):
    main.fork("main@2", "short")
    result = compare(main, "main", "short")
    assert result.position == 3 and result.step_b is None and result.changes == []
    assert result.step_a.id == main.show("main@3").id


def test_runs_with_the_same_content_have_no_first_difference(main):
    main.fork("main", "copy")
    result = compare(main, "main", "copy")
    assert result.is_same_content and result.position is None


def test_an_unknown_run_is_an_error(main):
    with pytest.raises(NotFoundError):
        compare(main, "main", "nosuchrun")


def test_a_fork_made_with_an_edit_names_the_edited_step_and_its_edited_text(main):
    main.fork("main@2", "edited", edit={"result": "392"})
    result = compare(main, "main", "edited")
    assert result.position == 2 and result.step_b.id == main.head("edited").id
    assert result.step_b.meta["edit_of"] == main.show("main@2").id
    assert [(c.field, c.a, c.b) for c in result.changes] == [("result", "391", "392")]
