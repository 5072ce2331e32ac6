"""analyze: the oracle bound per step and the prefix breakers, from the tokenizer alone."""

from __future__ import annotations

import pytest

from kvtrace.errors import ReplayError
from kvtrace.replay import analyze

SYSTEM = "You answer with tools.\nTools:\n- calculator: arithmetic\n- lookup: city facts"


def _record_agent(store, name, *, system=lambda i: SYSTEM, first_user=lambda i, u: u, calls=5):
    """A linear agent run: each prompt is the previous one plus response and observation."""
    run = store.run(name)
    messages = [{"role": "user", "content": "Question: what is 6 times 7?"}]
    for i in range(calls):
        prompt = [{"role": "system", "content": system(i)}, *[dict(m) for m in messages]]
        prompt[1] = {"role": "user", "content": first_user(i, prompt[1]["content"])}
        response = f"Action: calculator\nAction Input: 6*{7 + i}"
        run.record_model_call(prompt, {"role": "assistant", "content": response}, model="m")
        run.record_tool_call("calculator", f"6*{7 + i}", 6 * (7 + i))
        messages += [
            {"role": "assistant", "content": response},
            {"role": "user", "content": f"Observation: {6 * (7 + i)}"},
        ]
    return run


def test_a_clean_agent_run_has_no_breakers_and_a_high_oracle_bound(replay_store, byte_tokenizer):
    _record_agent(replay_store, "clean")
    result = analyze(replay_store, "clean", byte_tokenizer)
    assert result.breakers == []
    assert len(result.steps) == 5
    # Every later prompt extends the previous context: only its new tail is outside the bound.
    for before, step in zip(result.steps, result.steps[1:], strict=False):
        assert step.shared_with_previous is not None
        assert step.shared_with_previous > before.prompt_tokens
        assert step.oracle_tokens == step.shared_with_previous


def test_finds_a_timestamp_in_the_system_prompt(replay_store, byte_tokenizer):
    stamps = [
        "2024-05-01 09:00:01",
        "2024-05-01 09:00:07",
        "2024-05-01 09:00:13",
        "2024-05-01 09:01:02",
        "2024-05-01 09:01:40",
    ]
    _record_agent(replay_store, "stamped", system=lambda i: f"Current time: {stamps[i]}\n{SYSTEM}")
    result = analyze(replay_store, "stamped", byte_tokenizer)
    assert [b.index for b in result.breakers] == [2, 3, 4, 5]
    first = result.breakers[0]
    assert first.cause == "timestamp"
    assert "system prompt" in first.explanation
    assert first.message_index == 0
    # Byte tokens: the break is at the first differing character of the timestamp.
    prefix = "<s>system\nCurrent time: 2024-05-01 09:00:0"
    assert first.token_position == len(prefix.encode()) - 3 + 1  # <s> is one token
    assert first.char_position == len(prefix)
    assert first.previous.startswith("1") and first.current.startswith("7")
    assert result.steps[1].oracle_tokens == first.token_position


def test_finds_a_reordered_tool_list(replay_store, byte_tokenizer):
    orders = [
        SYSTEM,
        SYSTEM.replace(
            "- calculator: arithmetic\n- lookup: city facts",
            "- lookup: city facts\n- calculator: arithmetic",
        ),
    ]
    _record_agent(replay_store, "reordered", system=lambda i: orders[i % 2], calls=3)
    result = analyze(replay_store, "reordered", byte_tokenizer)
    assert [b.cause for b in result.breakers] == ["reordered_list", "reordered_list"]
    assert "tool list" in result.breakers[0].explanation


def test_finds_a_document_inserted_in_front(replay_store, byte_tokenizer):
    def with_document(i, text):
        return f"Document {i}: Rome has 2873000 people.\n{text}" if i == 2 else text

    _record_agent(replay_store, "inserted", first_user=with_document, calls=3)
    result = analyze(replay_store, "inserted", byte_tokenizer)
    assert result.breakers and result.breakers[0].index == 3
    assert result.breakers[0].cause == "inserted_in_front"


def test_finds_an_output_edited_before_being_sent_back(replay_store, byte_tokenizer):
    run = replay_store.run("edited")
    first = [{"role": "user", "content": "Question: 2+2?"}]
    run.record_model_call(first, "Action: calculator\nAction Input: 2+2  ", model="m")
    second = [
        *first,
        {"role": "assistant", "content": "Action: calculator\nAction Input: 2+2"},
        {"role": "user", "content": "Observation: 4"},
    ]
    run.record_model_call(second, "Final Answer: 4", model="m")
    result = analyze(replay_store, "edited", byte_tokenizer)
    assert [b.cause for b in result.breakers] == ["edited_output"]


def test_to_dict_carries_steps_breakers_and_total(replay_store, byte_tokenizer):
    _record_agent(
        replay_store, "stamped", system=lambda i: f"Date: 2024-05-0{i + 1}\n{SYSTEM}", calls=2
    )
    data = analyze(replay_store, "stamped", byte_tokenizer).to_dict()
    assert set(data) >= {"steps", "breakers", "total"}
    assert data["total"]["breakers"] == 1 and data["breakers"][0]["cause"] == "timestamp"
    assert data["total"]["lost_tokens"] > 0


def test_an_empty_run_is_an_error_not_an_empty_analysis(replay_store, byte_tokenizer):
    replay_store.run("empty")
    with pytest.raises(ReplayError, match="no steps to analyze"):
        analyze(replay_store, "empty", byte_tokenizer)
