"""`make_server`: one answerer, local or upstream, and recording only when given a store."""

from __future__ import annotations

import httpx
import pytest

from kvtrace.errors import UsageError
from kvtrace.serve import make_server
from tests.canned import CANNED_COMPLETION, CANNED_STREAM

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def test_without_a_store_calls_are_answered_and_nothing_is_recorded(
    sqlite_store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(None, canned_upstream.url, run="unrecorded")
    plain = httpx.post(f"{proxy.url}/chat/completions",
                       json={"model": "canned-model", "messages": QUESTION})
    with httpx.stream("POST", f"{proxy.url}/chat/completions",
                      json={"model": "canned-model", "messages": QUESTION,
                            "stream": True}) as streamed:
        received = b"".join(streamed.iter_raw())
    assert plain.content == CANNED_COMPLETION and received == b"".join(CANNED_STREAM)
    assert proxy.server.stats == {} and proxy.server.recording.store is None
    bad = httpx.post(f"{proxy.url}/chat/completions", headers={"X-Kvtrace-Run": "a..b"},
                     json={"model": "canned-model", "messages": QUESTION})
    assert bad.status_code == 400  # the run header is still checked


def test_upstream_health_names_the_upstream_and_the_model_list_is_not_recorded(
    sqlite_store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(sqlite_store, canned_upstream.url + "/", run="h")
    health = httpx.get(proxy.url.removesuffix("/v1") + "/health").json()
    assert health == {"status": "ok", "mode": "upstream", "run": "h",
                      "upstream": canned_upstream.url}
    models = httpx.get(f"{proxy.url}/models").json()
    assert models["data"][0]["id"] == "canned-model"
    assert canned_upstream.seen[-1]["path"] == "/v1/models"
    assert sqlite_store.runs() == []


@pytest.mark.parametrize("options", [{}, {"backend": object(), "upstream": "http://x/v1"}],
                         ids=["neither", "both"])
def test_a_server_answers_from_exactly_one_of_backend_and_upstream(options):
    with pytest.raises(UsageError, match="exactly one of backend= and upstream="):
        make_server(**options)


def test_an_upstream_url_must_be_http_with_its_api_prefix():
    with pytest.raises(UsageError, match="must start with http:// or https://"):
        make_server(upstream="ftp://example.org/v1")


@pytest.mark.parametrize(("options", "message"), [
    ({"api_key": ""}, "api_key is empty"),
    ({"api_key": " "}, "api_key must be visible ASCII"),
    ({"api_key": "clé"}, "api_key must be visible ASCII"),
    ({"upstream_api_key": "a key"}, "upstream_api_key must be visible ASCII"),
])
def test_a_key_that_could_never_match_or_would_match_nothing_is_refused(options, message):
    with pytest.raises(UsageError, match=message):
        make_server(upstream="http://127.0.0.1:9/v1", **options)


def test_a_server_recording_into_many_runs_keeps_a_writer_for_the_last_ones_only(
    sqlite_store, canned_upstream, serve_upstream
):
    from kvtrace.serve.recording import MAX_RECORDERS

    proxy = serve_upstream(sqlite_store, canned_upstream.url, run="default")
    names = [f"session-{i}" for i in range(MAX_RECORDERS + 20)] + ["session-0"]
    with httpx.Client(base_url=proxy.url) as client:
        for name in names:  # one agent session per run, as X-Kvtrace-Run names them
            answer = client.post("/chat/completions", headers={"X-Kvtrace-Run": name},
                                 json={"model": "canned-model", "messages": QUESTION})
            assert answer.status_code == 200
    kept = proxy.server.recording._writer._recorders
    assert len(kept) == MAX_RECORDERS and list(kept)[-1] == "session-0"
    # each run holds its steps, the one written again after its writer was let go too
    assert [len(sqlite_store.path(name)) for name in ("session-0", names[-2])] == [2, 1]
    assert proxy.server.stats["session-0"].calls == 2
