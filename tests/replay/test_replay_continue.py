"""continue_run: new model steps generated live and recorded, tools called by name."""

from __future__ import annotations

import socket

import pytest

from kvtrace.errors import BackendError, MissingToolError, RunNotFoundError, UsageError
from kvtrace.replay import RemoteBackend, RetryPolicy, continue_run

START = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Question: what is 6 times 7?"},
]


def _scripted(*replies):
    """A stand-in 'model' that answers by turn number (number of assistant turns so far)."""

    def answer(messages):
        turn = sum(1 for m in messages if m["role"] == "assistant")
        return replies[min(turn, len(replies) - 1)]

    return answer


def test_a_missing_tool_stops_with_an_error_naming_it(replay_store, stand_in_server):
    server = stand_in_server(_scripted("Action: weather\nAction Input: Rome"))
    backend = RemoteBackend(server.url, model="stand-in")
    with pytest.raises(MissingToolError, match="'weather'") as info:
        continue_run(
            replay_store,
            "agent",
            backend,
            steps=3,
            messages=START,
            tools={"calculator": lambda expr: 42},
        )
    assert "calculator" in str(info.value)  # says what is registered
    # The model call that asked did happen, so it is recorded; no tool step follows it.
    head = replay_store.head("agent")
    assert head is not None and head.kind == "model_call" and head.depth == 1


def test_tools_run_and_both_steps_are_recorded_until_a_final_answer(store, stand_in_server):
    server = stand_in_server(_scripted("Action: calculator\nAction Input: 6*7", "Final Answer: 42"))
    calls = []

    def calculator(expression):
        calls.append(expression)
        return 42

    result = continue_run(
        store,
        "agent",
        RemoteBackend(server.url, model="stand-in"),
        steps=5,
        messages=START,
        tools={"calculator": calculator},
    )
    assert calls == ["6*7"]
    assert [s.kind for s in result.new_steps] == ["model_call", "tool_call", "model_call"]
    assert result.final_answer == "42" and result.is_finished
    tool_step = result.new_steps[1]
    assert tool_step.meta["tool"] == "calculator" and tool_step.content["result"] == 42
    assert server.requests[1]["messages"][-1] == {"role": "user", "content": "Observation: 42"}


def test_continuing_a_fork_sends_the_edited_tool_result(store, stand_in_server):
    server = stand_in_server(
        _scripted("Action: calculator\nAction Input: 6*7", "Final Answer: done")
    )
    backend = RemoteBackend(server.url, model="stand-in")
    continue_run(
        store, "agent", backend, steps=1, messages=START, tools={"calculator": lambda e: 42}
    )
    fork = store.fork("agent@1", "agent-edit")
    fork.record_tool_call("calculator", "6*7", 41)
    result = continue_run(store, "agent-edit", backend, steps=2, tools={})
    assert server.requests[-1]["messages"][-1]["content"] == "Observation: 41"
    assert result.final_answer == "done"
    # The fork shares the parent's first call; the parent run is untouched.
    assert store.head("agent").depth == 2
    assert [s.depth for s in result.new_steps] == [3]


def test_a_failing_tool_is_recorded_as_an_error_and_shown_to_the_model(
    replay_store, stand_in_server
):
    server = stand_in_server(
        _scripted("Action: calculator\nAction Input: 1/0", "Final Answer: cannot")
    )

    def calculator(expression):
        raise ZeroDivisionError("division by zero")

    result = continue_run(
        replay_store,
        "agent",
        RemoteBackend(server.url, model="m"),
        steps=3,
        messages=START,
        tools={"calculator": calculator},
    )
    assert result.new_steps[1].meta["error"] == "ZeroDivisionError: division by zero"
    assert server.requests[1]["messages"][-1]["content"].startswith("Observation: error:")


def test_messages_cannot_restart_a_run_that_has_steps(replay_store, stand_in_server):
    server = stand_in_server(_scripted("Final Answer: x"))
    backend = RemoteBackend(server.url, model="m")
    continue_run(replay_store, "agent", backend, steps=1, messages=START)
    with pytest.raises(UsageError):
        continue_run(replay_store, "agent", backend, steps=1, messages=START)


def test_a_user_message_starts_the_next_task_of_a_finished_run(replay_store, stand_in_server):
    server = stand_in_server(_scripted("Final Answer: 42", "Final Answer: 43"))
    backend = RemoteBackend(server.url, model="m")
    continue_run(replay_store, "agent", backend, steps=1, messages=START)
    assert continue_run(replay_store, "agent", backend, steps=1).new_steps == []  # finished
    result = continue_run(
        replay_store, "agent", backend, steps=1, user_message="Question: and plus one?"
    )
    assert result.final_answer == "43"
    sent = server.requests[-1]["messages"]
    assert sent[-2:] == [
        {"role": "assistant", "content": "Final Answer: 42"},
        {"role": "user", "content": "Question: and plus one?"},
    ]


def test_an_unknown_run_without_messages_is_an_error_that_creates_nothing(
    replay_store, stand_in_server
):
    backend = RemoteBackend(stand_in_server(_scripted("Final Answer: 1")).url, model="stand-in")
    with pytest.raises(RunNotFoundError, match="no run named 'nosuch'"):
        continue_run(replay_store, "nosuch", backend, steps=1)
    assert [r.name for r in replay_store.runs()] == []


def test_a_new_run_exists_only_once_its_first_call_is_answered(store):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(BackendError):
        continue_run(store, "fresh", RemoteBackend(f"http://127.0.0.1:{port}/v1",
                                                   retry=RetryPolicy(max_attempts=1)),
                     steps=1, messages=START)
    assert [r.name for r in store.runs()] == []


def test_a_run_moved_since_the_workers_last_step_is_a_conflict(store, stand_in_server):
    from kvtrace.errors import ConflictError

    server = stand_in_server(_scripted("Action: calculator\nAction Input: 6*7", "Final Answer: 42"))
    backend = RemoteBackend(server.url, model="stand-in")
    first = continue_run(store, "agent", backend, steps=1, messages=START,
                         tools={"calculator": lambda expr: 41})
    last = first.new_steps[-1]
    store.revert("agent", to="agent@1")  # a supervisor steps in
    with pytest.raises(ConflictError, match="moved"):
        continue_run(store, "agent", backend, steps=1, expected_head=last.id,
                     tools={"calculator": lambda expr: 41})
    assert store.head("agent").depth == 1  # nothing built on the reverted history


def test_function_calling_runs_continue_with_tool_messages(store, stand_in_server):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    server = stand_in_server(_scripted(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>',
        "It is 42."))
    result = continue_run(store, "fc", RemoteBackend(server.url, model="stand-in"),
                          steps=3, messages=START, tool_definitions=tools,
                          tools={"calculator": lambda args: 6 * 7})
    assert [s.kind for s in result.new_steps] == ["model_call", "tool_call", "model_call"]
    call = result.new_steps[0].content["response"]["tool_calls"][0]
    assert result.new_steps[1].meta["call_id"] == call["id"]
    sent = server.requests[1]
    assert sent["tools"] == tools
    assert sent["messages"][-1] == {"role": "tool", "tool_call_id": call["id"],
                                    "name": "calculator", "content": "42"}
    assert result.final_answer == "It is 42."


def test_calls_a_response_still_owes_run_before_the_next_user_turn(replay_store, stand_in_server):
    from kvtrace.replay.continuation import conversation_at

    run = replay_store.run("owed")
    run.record_model_call(START, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "calculator", "arguments": "{}"}},
    ]}, model="m")
    run.record_tool_call("calculator", {}, 1, call_id="c1")  # c2 was never answered
    state = conversation_at(replay_store.path("owed"), "and now?")
    assert [c["id"] for c in state.pending] == ["c2"] and state.follow_up == "and now?"
    server = stand_in_server(_scripted("Done."))
    continue_run(replay_store, "owed", RemoteBackend(server.url, model="stand-in"), steps=1,
                 user_message="and now?", tools={"calculator": lambda args: 2})
    sent = server.requests[0]["messages"]
    assert [(m["role"], m.get("tool_call_id")) for m in sent[-3:]] == [
        ("tool", "c1"), ("tool", "c2"), ("user", None)]
