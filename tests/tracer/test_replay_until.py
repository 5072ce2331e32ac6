"""`ReplayTransport(run, mode="new_episodes", until=K)`: `--from RUN@K` from Python."""

from __future__ import annotations

import httpx
import pytest

from kvtrace.errors import UsageError
from kvtrace.store import ModelCall, StepKind
from kvtrace.tracer import RecordingTransport, ReplayTransport
from tests.tracer.test_transport import run_weather_agent, sdk


def _model_calls(store, run):
    return [s for s in store.path(run) if s.kind == StepKind.MODEL_CALL]


@pytest.fixture
def recorded(store, canned_upstream):
    run_weather_agent(sdk(canned_upstream.url, RecordingTransport(store.run("agent"))))
    assert len(_model_calls(store, "agent")) == 2
    return store


def test_the_first_k_calls_are_served_and_the_rest_recorded_on_a_fork(recorded,
                                                                     canned_upstream):
    store = recorded
    transport = ReplayTransport(store.run("agent"), mode="new_episodes", until=1,
                                inner=httpx.HTTPTransport())
    seen_before = len(canned_upstream.seen)
    assert run_weather_agent(sdk(canned_upstream.url, transport)) == "It is sunny in Paris."
    assert len(canned_upstream.seen) == seen_before + 1  # only the live call went out
    summary = transport.prefix.summary
    assert (summary.num_served, summary.first_live_step, summary.fork) == (1, 2, "agent-from-1")
    base, fork = _model_calls(store, "agent"), _model_calls(store, "agent-from-1")
    assert fork[0].id == base[0].id and len(fork) == 2
    assert fork[1].parent_id == base[0].id  # the live call follows the shared step
    assert len(_model_calls(store, "agent")) == 2  # the recording is untouched


def test_an_edited_step_k_is_served_and_the_fork_starts_from_the_edit(recorded,
                                                                    canned_upstream):
    store = recorded
    first = _model_calls(store, "agent")[0]
    edited = ModelCall(first).response | {"tool_calls": [{
        "id": "call_abc", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    transport = ReplayTransport(store.run("agent"), mode="new_episodes", until=1,
                                inner=httpx.HTTPTransport(), fork="oslo",
                                edit={"response": edited})
    run_weather_agent(sdk(canned_upstream.url, transport))
    fork = _model_calls(store, "oslo")
    assert ModelCall(fork[0]).edit_of == first.id
    assert '"Oslo"' in ModelCall(fork[0]).response["tool_calls"][0]["function"]["arguments"]
    assert transport.prefix.summary.edit_seen is True and len(fork) == 2


@pytest.mark.parametrize(("options", "message"), [
    ({"mode": "none", "until": 1}, "goes with mode='new_episodes'"),
    ({"mode": "new_episodes", "until": 0}, "until must be a step number"),
    ({"mode": "new_episodes", "fork": "x"}, "fork and edit go with until"),
    ({"mode": "new_episodes", "until": 1, "fork": "agent"}, "exists already"),
    ({"mode": "new_episodes", "until": 1, "edit": {"colour": 1}}, "no field 'colour'"),
])
def test_bad_until_options_are_refused_and_change_nothing(recorded, options, message):
    store = recorded
    runs = [info.name for info in store.runs()]
    with pytest.raises(UsageError, match=message):
        ReplayTransport(store.run("agent"), **options)
    assert [info.name for info in store.runs()] == runs
