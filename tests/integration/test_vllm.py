"""kvtrace in front of vLLM's CPU build: replay on its own tokens and blocks, from a cold
cache; record an SDK agent through it; fork two agents onto it; replay runs concurrently."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from kvtrace import open_store
from tests.integration.conftest import kv

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 12  # > 128 tokens
AGENT = textwrap.dedent(f"""
    import sys
    import openai
    client = openai.OpenAI(max_retries=0)
    messages = [{{"role": "system", "content": {SYSTEM!r}}},
                {{"role": "user", "content": "Name three colours."}}]
    for turn in range(3):
        reply = client.chat.completions.create(model="smollm2", messages=messages,
                                               max_tokens=12, temperature=0)
        messages += [{{"role": "assistant", "content": reply.choices[0].message.content}},
                     {{"role": "user", "content": f"Another one, please ({{turn}})."}}]
    print(reply.choices[0].message.content, file=sys.stderr)  # stdout: kvtrace's --json
""")


@pytest.fixture
def agent(home):
    """The SDK agent's script, in the home's folder."""
    (home / "agent.py").write_text(AGENT)
    return home / "agent.py"


def _record_conversation(name: str, turns: int = 3) -> None:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Name three colours."}]
    with open_store() as store:
        run = store.run(name)
        for turn in range(turns):
            answer = f"Colour number {turn}: teal."
            run.record_model_call(list(messages), answer, model="smollm2",
                                  params={"temperature": 0, "max_tokens": 12})
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"Another one, please ({turn})."}]


def test_replay_counts_in_vllms_tokens_and_blocks_from_a_cold_cache(home, vllm_server, capfd):
    _record_conversation("recorded")
    code, _, err = kv(capfd, "replay", "recorded", "--backend", vllm_server, "--json")
    assert code == 0, err  # now vLLM holds the whole run
    code, out, err = kv(capfd, "replay", "recorded", "--backend", vllm_server, "--reset-cache",
                        "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["reset"] == "/reset_prefix_cache"
    steps = report["steps"]
    assert steps[0]["reused_tokens"] == 0  # cold, though the replay before warmed it
    engine = report["engine"]
    assert engine["tokens"].startswith("the engine's own tokens (/tokenize")
    assert (engine["block_size"], engine["block_size_from"]) == (128, "its /metrics")
    for step in steps:  # the oracle counted in the ids vLLM saw: never past 100 %
        assert step["oracle_prompt_tokens"] == step["prompt_tokens"]
        assert step["oracle_hit_rate"] <= 1 and step["reused_tokens"] % 128 == 0
    total = report["total"]
    assert total["reused_tokens"] > 0
    # vLLM reaches the bound its blocks allow: the gap to token-exact is the engine's.
    assert total["reused_tokens"] == total["oracle_resume_tokens"] < total["oracle_tokens"]
    counters = report["engine_counters"]  # its /metrics over the replay agree with its usage
    assert counters["queried_tokens"] == total["prompt_tokens"]
    assert counters["hit_tokens"] == total["reused_tokens"]
    assert not report["notes"]


def test_record_an_sdk_agent_then_fork_two_agents_onto_vllm(agent, vllm_server, capfd):
    agent = str(agent)
    code, out, err = kv(capfd, "record", "--upstream", vllm_server, "--run", "base", "--json",
                        "--", sys.executable, agent)
    assert code == 0, err
    recorded = json.loads(out)["runs"]["base"]
    assert recorded["calls"] == 3 and recorded["unknown_cached"] == 0
    assert recorded["cached_tokens"] >= 2 * 128  # calls 2 and 3 reuse the system prompt
    code, out, err = kv(capfd, "record", "--from", "base@1", "--n", "2", "--upstream",
                        vllm_server, "--run", "exp", "--json", "--", sys.executable, agent)
    assert code == 0, err
    agents = json.loads(out)["agents"]
    assert [a["run"] for a in agents] == ["exp-1", "exp-2"]
    for run in agents:
        assert run["exit_code"] == 0
        assert (run["from"]["num_served"], run["from"]["first_live_step"]) == (1, 2)
        assert run["live_calls"] == 2 and run["cached_tokens"] >= 2 * 128
    with open_store() as store:
        base = store.path("base")
        for name in ("exp-1", "exp-2"):
            fork = store.path(name)
            assert fork[0].id == base[0].id and len(fork) == 3


def test_replay_runs_concurrently_through_vllm(home, vllm_server, capfd):
    for name in ("eval-1", "eval-2", "eval-3"):
        _record_conversation(name)
    code, out, err = kv(capfd, "replay", "eval-*", "--backend", vllm_server, "--reset-cache",
                        "--concurrency", "3", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["reset"] == "/reset_prefix_cache" and report["total"]["ok_runs"] == 3
    assert report["engine"]["block_size"] == 128
    # Each run's cached tokens, and the engine's own count over all of them.
    per_run = [run["report"]["total"]["reused_tokens"] for run in report["runs"]]
    assert all(reused > 0 for reused in per_run)
    assert report["engine_counters"]["hit_tokens"] == sum(per_run)
