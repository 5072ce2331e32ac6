"""The remote backend against a stand-in OpenAI-compatible server on a real loopback socket."""

from __future__ import annotations

import socket

import pytest

from kvtrace.errors import BackendError
from kvtrace.replay import RemoteBackend, RetryPolicy, replay


def _answer(messages):
    """The stand-in's deterministic 'model': it names how many messages it saw."""
    return f"Final Answer: {len(messages)} messages"


def _record(store, name, calls=6):
    run = store.run(name)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Question: count the messages."},
    ]
    for i in range(calls):
        run.record_model_call(
            list(messages),
            _answer(messages),
            model="stand-in",
            params={"temperature": 0, "max_tokens": 64},
        )
        messages += [
            {"role": "assistant", "content": _answer(messages)},
            {"role": "user", "content": f"Observation: turn {i}"},
        ]


def test_verify_reads_cached_tokens_from_usage_and_matches_the_oracle(
    store, stand_in_server, byte_tokenizer
):
    _record(store, "r")
    server = stand_in_server(_answer)
    report = replay(
        store, "r", RemoteBackend(server.url, tokenizer=byte_tokenizer), mode="verify"
    )
    assert [s.reused_tokens for s in report.steps] == server.cached_answers
    assert report.steps[0].reused_tokens == 0 and report.steps[-1].reused_tokens > 0
    assert report.total.reused_tokens == report.total.oracle_tokens
    assert report.is_match is True
    assert report.steps[0].memory_tokens is None  # the server does not say which tier
    assert server.requests[0]["model"] == "stand-in"  # the recorded model, by default
    assert server.requests[0]["temperature"] == 0 and server.requests[0]["max_tokens"] == 64


def test_a_server_that_does_not_report_cached_tokens_gives_unknown(
    replay_store, stand_in_server, byte_tokenizer
):
    _record(replay_store, "r", calls=3)
    server = stand_in_server(_answer, reports_cached=False)
    report = replay(replay_store, "r", RemoteBackend(server.url, tokenizer=byte_tokenizer))
    assert all(s.reused_tokens is None and s.hit_rate is None for s in report.steps)
    data = report.to_dict()
    assert data["total"]["reused_tokens"] is None and data["total"]["hit_rate"] is None
    assert data["total"]["oracle_tokens"] > 0  # the oracle needs only the tokenizer


def test_verify_reports_the_first_differing_token_of_a_remote_answer(
    replay_store, stand_in_server, byte_tokenizer
):
    _record(replay_store, "r", calls=2)
    server = stand_in_server(lambda m: _answer(m).replace("messages", "msgs"))
    report = replay(
        replay_store, "r", RemoteBackend(server.url, tokenizer=byte_tokenizer), mode="verify"
    )
    assert report.is_match is False and report.total.first_mismatch == 1
    mismatch = report.steps[0].mismatch
    assert mismatch is not None
    assert mismatch.position == len("Final Answer: 2 m")
    assert mismatch.expected_text.startswith("essages") and mismatch.got_text.startswith("sgs")


def test_rebuild_primes_each_prompt_with_one_token(replay_store, stand_in_server):
    _record(replay_store, "r", calls=3)
    server = stand_in_server(_answer)
    report = replay(
        replay_store, "r", RemoteBackend(server.url, model="served-name"), mode="rebuild"
    )
    assert [r["max_tokens"] for r in server.requests] == [1, 1, 1]
    assert server.requests[0]["model"] == "served-name"
    assert report.steps[0].oracle_tokens is None  # no tokenizer given
    assert report.notes


def test_http_errors_become_backend_errors(replay_store, stand_in_server):
    _record(replay_store, "r", calls=1)
    server = stand_in_server(_answer, fail_status=500)
    with pytest.raises(BackendError, match="HTTP 500, after 2 attempts"):
        replay(replay_store, "r", RemoteBackend(
            server.url, retry=RetryPolicy(max_attempts=2, base_delay_s=0.001)))


def test_an_unreachable_server_is_a_backend_error(replay_store):
    _record(replay_store, "r", calls=1)
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(BackendError, match="cannot reach"):
        replay(replay_store, "r", RemoteBackend(f"http://127.0.0.1:{port}/v1",
                                                retry=RetryPolicy(max_attempts=1)))
