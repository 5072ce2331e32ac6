"""`kvtrace serve`'s OpenAPI schema, fuzzed with schemathesis against a real server.

The server (local mode, the tiny random model, a real SQLite store) runs on
a loopback port; schemathesis loads `GET /openapi.json` from it and
generates requests for every operation, valid ones and ones that break the
schema, most to the three model-call routes (chat completions, Anthropic
Messages, OpenAI Responses). For each: no 5xx; a rejected request (4xx)
leaves the store's steps as they were; an accepted model call adds exactly
one step. The same runs against upstream mode, a proxy in front of a local
server.
KVTRACE_SCHEMATHESIS_EXAMPLES sets the number of requests (60; half that
for the proxy).
"""

from __future__ import annotations

import os

import httpx
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvtrace.store.db.schema import steps

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = int(os.environ.get("KVTRACE_SCHEMATHESIS_EXAMPLES", "60"))
UPSTREAM_EXAMPLES = max(1, EXAMPLES // 2)


def num_steps(store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(steps)).scalar_one())


MODEL_CALLS = ("/v1/chat/completions", "/v1/messages", "/v1/responses")


def bound_new_tokens(body) -> None:
    """A valid `max_tokens` stays valid but at most 16: the tiny model's context is 8,192
    tokens, and generating thousands of them per example would take minutes."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 16:
                body[name] = 16


def fuzz(base: str, store, examples: int, prepare=bound_new_tokens) -> dict[str, int]:
    """Send `examples` generated requests to the server at `base`; check each (the module
    docstring) against `store`, the one it records into; the counts of what was answered."""
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    paths = set(schema.raw_schema["paths"])
    assert {*MODEL_CALLS, "/v1/models", "/health"} <= paths
    operation_ids = [operation["operationId"] for item in schema.raw_schema["paths"].values()
                     for operation in item.values()]
    assert len(operation_ids) == len(set(operation_ids))  # unique, as OpenAPI requires
    calls = [schema[path]["POST"] for path in MODEL_CALLS]
    cases = st.one_of(*[call.as_strategy(mode) for call in calls
                        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)],
                      schema.as_strategy(GenerationMode.POSITIVE),
                      schema.as_strategy(GenerationMode.NEGATIVE))
    seen: dict[str, int] = {"accepted_calls": 0, "rejected": 0, "other_accepted": 0}

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])  # no shrinking: each call is a real request
    @given(case=cases)
    def check(case) -> None:
        prepare(case.body)
        before = num_steps(store)
        response = case.call(base_url=base, timeout=30)
        after = num_steps(store)
        what = f"{case.method} {case.formatted_path} {case.body!r:.300} -> {response.status_code}"
        assert response.status_code < 500, f"{what}: {response.text[:500]}"
        if 400 <= response.status_code < 500:
            seen["rejected"] += 1
            assert after == before, f"{what}: a rejected request recorded a step"
        elif case.path in MODEL_CALLS:
            seen["accepted_calls"] += 1
            seen[case.path] = seen.get(case.path, 0) + 1
            assert after == before + 1, f"{what}: an answered call recorded {after - before}"
        else:
            seen["other_accepted"] += 1
            assert after == before, f"{what}: a read recorded a step"

    check()
    print(f"schemathesis, {examples} examples: {seen}")  # the counts docs/reliability.md quotes
    return seen


def test_generated_requests_never_get_a_5xx_and_a_rejected_one_records_nothing(
    sqlite_store, serve_local
):
    server = serve_local(sqlite_store, run="fuzz")
    seen = fuzz(server.url.removesuffix("/v1"), sqlite_store, EXAMPLES)
    assert seen["rejected"] > 0 and seen["accepted_calls"] > 0, seen


def test_upstream_mode_in_front_of_a_local_server_holds_to_the_same_rules(
    sqlite_store, serve_local, serve_upstream, tiny_engine, tmp_path
):
    """The proxy's checks, forwarding and recording, fuzzed (a valid body names the served
    model, as a strict upstream would require)."""
    from kvtrace import open_store

    upstream_store = open_store(f"sqlite:///{tmp_path / 'upstream.db'}")
    upstream = serve_local(upstream_store, run="behind")
    proxy = serve_upstream(sqlite_store, upstream.url, run="fuzz-proxy")

    def prepare(body) -> None:
        bound_new_tokens(body)
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            body["model"] = tiny_engine.name

    seen = fuzz(proxy.url.removesuffix("/v1"), sqlite_store, UPSTREAM_EXAMPLES, prepare)
    assert seen["rejected"] > 0 and seen["accepted_calls"] > 0, seen
    upstream_store.close()


@pytest.mark.parametrize("role", [[], {}, ["user"]])
def test_a_message_whose_role_is_a_list_or_object_is_a_400_recording_nothing(
    sqlite_store, serve_local, tiny_engine, role
):
    server = serve_local(sqlite_store, run="roles")  # found by the fuzz test: it was a 500
    body = {"model": tiny_engine.name, "messages": [{"role": role, "content": "hi"}]}
    response = httpx.post(f"{server.url}/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert "messages[0].role" in response.json()["error"]["message"]
    assert num_steps(sqlite_store) == 0


@pytest.mark.parametrize("sampling", [{"temperature": 1e-300}, {"temperature": 5e-324},
                                      {"temperature": 1e-300, "top_p": 1e-300},
                                      {"temperature": 1.0, "top_p": 1e-300}])
def test_a_temperature_or_top_p_near_zero_samples_the_greedy_answer_and_records_it(
    sqlite_store, serve_local, tiny_engine, sampling
):
    server = serve_local(sqlite_store, run="cold")  # found by the fuzz test: it was a 500 (NaN)
    body = {"model": tiny_engine.name, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hi."}]}
    greedy = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    sampled = httpx.post(f"{server.url}/chat/completions", json={**body, **sampling,
                                                                 "seed": 1}, timeout=60)
    assert sampled.status_code == 200, sampled.text
    assert (sampled.json()["choices"][0]["message"]["content"]
            == greedy.json()["choices"][0]["message"]["content"])
    assert num_steps(sqlite_store) == 2
