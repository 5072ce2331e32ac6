"""An OpenAI Agents SDK agent, run unchanged under `kvtrace record`, is recorded call by call.

The agent is a plain script (tests write it to a file and run it as its own
process): two function tools, the SDK's default model provider (the
Responses API, configured only by the environment `kvtrace record` sets).
A tiny random model cannot be led to call tools, so the tool-calling agent
runs in upstream mode against tests/serve/canned_proxied.py, whose scripted
model calls each tool once and then answers; a toolless agent runs against
the local engine with the default model (marked slow).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from kvtrace import open_store
from kvtrace.apis import ProviderApi
from kvtrace.cli import main
from kvtrace.store.kinds import ModelCall, view

AGENT = textwrap.dedent('''
    import asyncio
    import sys

    from agents import Agent, Runner, function_tool


    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"


    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        return f"noon in {city}"


    agent = Agent(name="planner", instructions="Use both tools, then answer.",
                  model="gpt-4o-mini", tools=[get_weather, get_time])


    async def streamed() -> str:
        result = Runner.run_streamed(agent, "Plan a day in Paris.")
        async for _ in result.stream_events():
            pass
        return result.final_output


    if sys.argv[1] == "stream":
        print("final:", asyncio.run(streamed()))
    else:
        print("final:", Runner.run_sync(agent, "Plan a day in Paris.").final_output)
''')
GREETER = textwrap.dedent('''
    from agents import Agent, Runner

    agent = Agent(name="geographer", instructions="You are a helpful assistant.",
                  model="gpt-4o-mini")
    print("final:", Runner.run_sync(agent, "What is the capital of France?").final_output)
''')
FINAL = "final: Done: sunny in Paris; noon in Paris"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")  # no export to api.openai.com
    for name in ("KVTRACE_STORE", "OPENAI_BASE_URL", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "greeter.py").write_text(GREETER)
    return tmp_path


def record(capfd, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["record", *argv])
    out, err = capfd.readouterr()
    return int(exit_info.value.code or 0), out, err


@pytest.mark.parametrize("mode", ["plain", "stream"])
def test_an_agent_with_two_tools_runs_unchanged_and_every_call_is_recorded(
    home, capfd, canned_apis, mode
):
    code, out, err = record(capfd, "--upstream", canned_apis.url, "--run", "agent", "--",
                            sys.executable, str(home / "agent.py"), mode)
    assert code == 0, err
    assert FINAL in out
    bodies = [json.loads(seen["body"]) for seen in canned_apis.seen]
    assert [seen["path"] for seen in canned_apis.seen] == ["/v1/responses"] * 3
    assert all(body.get("stream", False) is (mode == "stream") for body in bodies)
    outputs = [item for item in bodies[2]["input"] if item.get("type") == "function_call_output"]
    assert [(o["call_id"], o["output"]) for o in outputs] == [
        ("call_script_0", "sunny in Paris"), ("call_script_1", "noon in Paris")]
    with open_store() as store:
        steps = store.path("agent")
        assert len(steps) == 3 and all(view(step).is_complete for step in steps)


@pytest.mark.parametrize("mode", ["plain", "stream"])
def test_the_agent_s_calls_are_model_call_steps_with_their_tool_calls(
    home, capfd, canned_apis, mode
):
    code, _, err = record(capfd, "--upstream", canned_apis.url, "--run", "agent", "--",
                          sys.executable, str(home / "agent.py"), mode)
    assert code == 0, err
    with open_store() as store:
        calls = [ModelCall(step) for step in store.path("agent")]
    assert [call.api for call in calls] == [ProviderApi.OPENAI_RESPONSES] * 3
    assert [[c["function"]["name"] for c in call.response.get("tool_calls") or []]
            for call in calls] == [["get_weather"], ["get_time"], []]
    assert [m["content"] for m in calls[2].messages if m["role"] == "tool"] == [
        "sunny in Paris", "noon in Paris"]
    assert calls[2].response["content"] == "Done: sunny in Paris; noon in Paris"
    assert [call.usage.cached_tokens for call in calls] == [0, 90, 90]


@pytest.mark.slow
def test_a_toolless_agent_runs_unchanged_against_the_local_engine(home, capfd):
    code, out, err = record(capfd, "--run", "greeter", "--", sys.executable,
                            str(home / "greeter.py"))
    assert code == 0, err
    assert out.startswith("final: ") and "Paris" in out  # the default model, greedy
    assert err.count("every model name is answered by the local model") == 1
    with open_store() as store:
        [step] = store.path("greeter")
    call = ModelCall(step)
    assert call.api == ProviderApi.OPENAI_RESPONSES
    assert call.request_model == "gpt-4o-mini" and call.model != "gpt-4o-mini"
    assert call.native["instructions"] == "You are a helpful assistant."
    assert call.native["response"]["status"] == "completed"
    assert call.response["content"].strip() in out
