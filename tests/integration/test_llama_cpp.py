"""kvtrace against llama.cpp's OpenAI-compatible server (a third party, not kvtrace's own)."""

from __future__ import annotations

import json
import sys
import textwrap

import httpx
import openai

from kvtrace import open_store
from kvtrace.serve import BackgroundServer, make_server
from kvtrace.tracer import RecordingTransport
from tests.integration.conftest import kv

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three colours."}]


def test_serve_upstream_records_llama_cpp_answers_unchanged_streamed_and_not(
    home, llama_server
):
    store = open_store()
    with BackgroundServer(make_server(upstream=llama_server, store=store,
                                      run="llama").app) as proxy:
        # What the client received, byte for byte, captured on the client's side.
        client_side = store.run("client-side")
        sdk = openai.OpenAI(base_url=proxy.url, api_key="none", max_retries=0,
                            http_client=httpx.Client(transport=RecordingTransport(client_side)))
        plain = sdk.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16,
                                            temperature=0)
        stream = sdk.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16,
                                             temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert plain.choices[0].message.content and streamed == plain.choices[0].message.content
    recorded = store.path("llama")
    received = store.path("client-side")
    assert [s.content["response"] for s in recorded] == [s.content["response"] for s in received]
    assert [s.meta["extra"]["response"] for s in recorded] == [
        s.meta["extra"]["response"] for s in received]  # same ids: the same answers, unchanged
    assert recorded[1].meta["extra"]["http"]["stream"] is True
    assert all("cached_tokens" not in s.meta["usage"] for s in recorded)  # not reported
    store.close()


def test_record_upstream_runs_an_sdk_agent_against_llama_cpp(home, llama_server, capfd):
    agent = home / "agent.py"
    agent.write_text(textwrap.dedent(f"""
        import openai
        client = openai.OpenAI(max_retries=0)
        messages = {MESSAGES!r}
        reply = client.chat.completions.create(model="smollm2", messages=messages,
                                               max_tokens=12, temperature=0)
        messages += [{{"role": "assistant", "content": reply.choices[0].message.content}},
                     {{"role": "user", "content": "And two more?"}}]
        stream = client.chat.completions.create(model="smollm2", messages=messages,
                                                max_tokens=12, temperature=0, stream=True)
        print("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    """))
    code, out, err = kv(capfd, "record", "--upstream", llama_server, "--run", "agent", "--",
                        sys.executable, str(agent))
    assert code == 0, err
    assert "recorded run 'agent': 2 model calls" in err and "cached unknown" in err
    with open_store() as store:
        steps = store.path("agent")
    assert steps[1].content["response"]["content"] == out.strip()


def test_replay_with_llama_cpp_as_backend_reports_cached_tokens_as_unknown(
    home, llama_server, capfd
):
    with open_store() as store:
        run = store.run("recorded")
        run.record_model_call(MESSAGES, "Red, green and blue.", model="smollm2",
                              params={"temperature": 0, "max_tokens": 16})
        run.record_model_call(
            [*MESSAGES, {"role": "assistant", "content": "Red, green and blue."},
             {"role": "user", "content": "Two more?"}],
            "Yellow and purple.", model="smollm2", params={"temperature": 0, "max_tokens": 16})
    code, out, err = kv(capfd, "replay", "recorded", "--backend", llama_server,
                        "--mode", "rebuild", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert len(report["steps"]) == 2
    assert all(step["reused_tokens"] is None for step in report["steps"])


def test_bench_fork_peer_replays_a_run_and_its_forks_through_kvtrace_and_llama_cpp(
    home, llama_server
):
    from kvtrace.bench.peer import run_peer_bench

    figures = run_peer_bench(llama_server, peer_model="smollm2", calls=4, fork_steps=(1, 2),
                             trials=1)
    assert figures["requests"] == 3 * 4
    assert figures["forks"] == {"fork-1": {"served": 1, "first_live_step": 2},
                                "fork-2": {"served": 2, "first_live_step": 3}}
    assert figures["prompt_tokens"]["peer"] > 0 and figures["prompt_tokens"]["kvtrace"] > 0
    assert figures["computed_tokens"]["radix_tree"] < figures["computed_tokens"]["single_slot"]
