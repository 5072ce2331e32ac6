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
