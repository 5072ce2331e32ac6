"""One request recorded two ways, through `RecordingTransport` in the agent's process and
through `kvtrace serve --upstream`, is stored as the same bytes, for each of the three
provider APIs, plain and streamed: both paths read a request through its API's one module
(kvtrace/apis/), so its parameters, conversation and assembled stream cannot drift apart."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest

from kvtrace.tracer import RecordingTransport

TOOLS = {
    "chat": [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    "messages": [{"name": "get_weather", "description": "The weather in a city",
                  "input_schema": {"type": "object",
                                   "properties": {"city": {"type": "string"}}}}],
    "responses": [{"type": "function", "name": "get_weather",
                   "description": "The weather in a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
}
# Each API's request with its own conversation fields and parameters, plus the two fields
# every path leaves out of the parameters (`stream`, `stream_options`).
REQUESTS = {
    "chat": ("/chat/completions", {
        "model": "canned-model", "temperature": 0.25, "tools": TOOLS["chat"],
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Weather in Paris?"}]}),
    "messages": ("/messages", {
        "model": "claude-canned", "max_tokens": 256, "temperature": 0.25,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "tools": TOOLS["messages"], "metadata": {"user_id": "u-1"},
        "messages": [{"role": "user", "content": "Weather in Paris?"}]}),
    "responses": ("/responses", {
        "model": "gpt-canned", "max_output_tokens": 256, "instructions": "Be brief.",
        "reasoning": {"effort": "low"},
        "input": [{"role": "user", "content": "Weather in Paris?"}]}),
}
_TIMED = ("timings", "recorded_at")


def _stored(step: Any, upstream: str) -> tuple[str, str]:
    """A step's content (raw blobs, a kept stream, as hex) and meta as sorted JSON, less what
    differs between any two recordings (wall-clock timings) and the upstream's port."""
    meta = copy.deepcopy(step.meta)
    for key in _TIMED:
        meta.pop(key, None)

    def text(value: Any) -> str:
        return json.dumps(value, sort_keys=True, default=bytes.hex)

    return text(step.content), text(meta).replace(upstream, "UPSTREAM")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("api", sorted(REQUESTS))
def test_the_transport_and_the_proxy_store_the_same_bytes(
    api, stream, store, canned_upstream, canned_apis, serve_upstream
):
    path, body = REQUESTS[api]
    body = {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body
    upstream = canned_upstream.url if api == "chat" else canned_apis.url

    with httpx.Client(transport=RecordingTransport(store.run("by-transport"))) as client:
        direct = client.post(upstream + path, json=body)
    proxy = serve_upstream(store, upstream, run="by-proxy")
    proxied = httpx.post(proxy.url + path, json=body)

    assert direct.status_code == proxied.status_code == 200
    assert direct.content == proxied.content  # the same answer, so the same step is due
    by_transport, by_proxy = store.path("by-transport"), store.path("by-proxy")
    assert [s.kind for s in by_transport] == [s.kind for s in by_proxy] == ["model_call"]
    assert "stream_options" not in by_transport[0].meta["params"]
    assert _stored(by_proxy[0], upstream) == _stored(by_transport[0], upstream)
