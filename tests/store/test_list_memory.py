"""A long conversation's resolved lists share their address strings (the soak's RSS growth)."""

from __future__ import annotations


def test_a_conversation_keeps_each_address_once_in_memory(store):
    run = store.run("shared")
    messages = [{"role": "system", "content": "x"}]
    steps = []
    for i in range(30):
        messages = [*messages, {"role": "user", "content": f"q{i}"}]
        steps.append(run.record_model_call(messages, f"a{i}", model="m"))
        messages = [*messages, {"role": "assistant", "content": f"a{i}"}]
    first = store._lists[(steps[0].id, "messages")]
    last = store._lists[(steps[-1].id, "messages")]
    assert last.length == 60 and last.addresses()[: first.length] == first.addresses()
    # A chain of links, each holding the addresses its call added: 30 calls hold each
    # address once, not a copy of the history per call.
    assert last.links()[0] is first
    assert sum(len(link.items) for link in last.links()) == 60
    assert [s.content["messages"] for s in steps[-1:]] == [messages[:-1]]
