"""Replay owns what it touches (issue 11, item 11): continue appends after the head it
read, so another writer's steps are never silently built upon; a remote backend
closes its connections."""

from __future__ import annotations

import pytest

from kvtrace import ConflictError, open_store
from kvtrace.replay import RemoteBackend, continue_run

START = [{"role": "user", "content": "Question: what is 6 times 7?"}]


def test_continue_refuses_to_build_on_a_step_another_writer_added(
    store, stand_in_server
):
    other_writer = open_store(store.url)  # another connection, as another process has
    answered = []

    def answer(messages):
        if len(answered) == 1:  # while the model thinks about the 2nd call, someone appends
            other_writer.run("agent").record_note("a supervisor was here")
        answered.append(messages)
        return "Thought: more\nAction: calculator\nAction Input: 6*7"

    server = stand_in_server(answer)
    with RemoteBackend(server.url, model="stand-in") as backend:
        first = continue_run(store, "agent", backend, steps=1, messages=START,
                             tools={"calculator": lambda expr: 42})
        assert [s.kind for s in first.new_steps] == ["model_call", "tool_call"]
        with pytest.raises(ConflictError):
            continue_run(store, "agent", backend, steps=1,
                         tools={"calculator": lambda expr: 42})
    head = store.head("agent")
    assert head.kind == "note" and head.parent_id == first.new_steps[-1].id  # kept, not buried
    assert head.depth == 3
    other_writer.close()


def test_continue_on_a_new_run_refuses_one_another_writer_started(
    store, stand_in_server
):
    other_writer = open_store(store.url)

    def answer(messages):
        other_writer.run("fresh").record_note("started elsewhere")
        return "Final Answer: 42"

    server = stand_in_server(answer)
    with RemoteBackend(server.url, model="stand-in") as backend, pytest.raises(ConflictError):
        continue_run(store, "fresh", backend, steps=1, messages=START)
    assert store.head("fresh").kind == "note" and store.head("fresh").depth == 1
    other_writer.close()


def test_a_remote_backend_closes_its_connections_as_a_context_manager(stand_in_server):
    server = stand_in_server(lambda messages: "Final Answer: 42")
    with RemoteBackend(server.url, model="stand-in") as backend:
        client = backend._client  # the one place that holds sockets
        assert not client.is_closed
    assert client.is_closed
