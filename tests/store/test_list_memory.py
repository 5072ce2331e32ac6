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
    first = store._steps._lists[(steps[0].id, "messages")]
    last = store._steps._lists[(steps[-1].id, "messages")]
    assert last.length == 60 and last.addresses()[: first.length] == first.addresses()
    # A chain of links, each holding the addresses its call added: 30 calls hold each
    # address once, not a copy of the history per call.
    assert last.links()[0] is first
    assert sum(len(link.items) for link in last.links()) == 60
    assert [s.content["messages"] for s in steps[-1:]] == [messages[:-1]]


def _conversation(run, calls):
    """`calls` model calls of one growing conversation (2 more messages each); their steps."""
    messages, steps = [{"role": "system", "content": f"x of {run.name}"}], []
    for i in range(calls):
        messages = [*messages, {"role": "user", "content": f"q{i}"}]
        steps.append(run.record_model_call(messages, f"a{i}", model="m"))
        messages = [*messages, {"role": "assistant", "content": f"a{i}"}]
    return steps


def test_the_list_cache_is_bounded_by_the_addresses_it_holds(store):
    store._steps._lists.max_items = 30  # the bound, made small (1,000,000 by default)
    steps = _conversation(store.run("long"), 40)  # 40 links of 2 new addresses: 80 in all
    held = store._steps._lists
    assert held.num_items == sum(len(resolved.items) for resolved in held.values())
    assert held.num_items <= 30 + 2  # past the bound by one call's new addresses at most
    assert store.show(steps[-1].id).content["messages"][-1] == {"role": "user", "content": "q39"}
    assert [s.content["messages"] for s in store.log("long")] == [
        s.content["messages"] for s in reversed(steps)]


def test_a_process_that_only_reads_keeps_the_list_cache_bounded(store):
    steps = [step for i in range(40) for step in _conversation(store.run(f"r{i}"), 3)]
    reader = type(store)(store.engine, store.url)  # another Store on the same database
    reader._steps._lists.max_items = 50
    for step in steps:  # what a watcher or the UI does: reads, never an append
        reader.show(step.id)
        reader.head(f"r{steps.index(step) // 3}")
    # 40 runs of 3 links (2 new addresses each): 240 addresses met, one run's 6 past the bound
    assert reader._steps._lists.num_items <= 50 + 6
