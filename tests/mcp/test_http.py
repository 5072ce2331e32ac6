"""`kvtrace mcp --transport http`: streamable HTTP on loopback, reached with the SDK's client;
with `--api-key`, a request without the key is refused; a non-loopback address needs a key."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from mcp import MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from kvtrace import open_store
from tests.mcp.conftest import Client, cli_error, server_env

KEY = "mcp-test-key-7Q2"
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                         "clientInfo": {"name": "curl", "version": "1"}}}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture
def start(sqlite_url, tmp_path) -> Iterator[Callable[..., str]]:
    """`start(*options)`: `kvtrace mcp --transport http --port 0 OPTIONS`; its URL."""
    started: list[subprocess.Popen[str]] = []

    def run(*options: str) -> str:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvtrace", "--store", sqlite_url, "mcp", "--transport", "http",
             "--port", "0", "--json", *options],
            cwd=tmp_path, env=server_env(tmp_path / "cache"), stdout=subprocess.PIPE, text=True)
        started.append(process)
        said = _json_document(process)
        assert said["transport"] == "http" and said["url"].startswith("http://127.0.0.1:")
        return said["url"]

    yield run
    for process in started:
        process.terminate()  # SIGTERM: the server stops gracefully
        assert process.wait(timeout=30) == 0


def _json_document(process: subprocess.Popen[str]) -> dict[str, Any]:
    """The JSON document `--json` prints once the server listens (it may span lines)."""
    assert process.stdout is not None
    text = ""
    while True:
        line = process.stdout.readline()
        assert line, f"kvtrace mcp ended with {process.wait(timeout=30)} before listening"
        text += line
        if line.rstrip() == "}":
            return json.loads(text)


def http(url: str, headers: dict[str, str] | None = None) -> Callable[[], Any]:
    """The SDK's streamable HTTP transport to `url`, sending `headers` with every request."""

    @asynccontextmanager
    async def transport() -> AsyncIterator[Any]:
        async with create_mcp_http_client(headers=headers) as client, \
                streamable_http_client(url, http_client=client) as streams:
            yield streams

    return transport


def test_the_sdk_client_works_over_loopback_http(start, sqlite_url, name):
    with open_store(sqlite_url) as store:
        store.run(name).record_tool_call("t", {}, 1)
    client = Client(http(start()))
    try:
        assert name in [r["name"] for r in client.call("list_runs")["runs"]]
        noted = client.call("note", spec=name, text="over http")
        assert noted["text"] == "over http"
        assert json.loads(client.read(f"kvtrace://run/{name}"))["depth"] == 1
    finally:
        client.close()


def test_with_a_key_a_request_without_it_is_refused_and_with_it_served(start, sqlite_url):
    url = start("--api-key", KEY)
    refused = httpx.post(url, json=INITIALIZE, headers=HEADERS)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"].startswith("Bearer")
    assert refused.json()["error"]["data"] == {"reason": "invalid_api_key"}
    assert refused.json()["error"]["message"].startswith("no bearer token was sent")
    wrong = httpx.post(url, json=INITIALIZE, headers={**HEADERS, "Authorization": "Bearer no"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["message"].startswith("the bearer token is wrong")
    client = Client(http(url, {"Authorization": f"Bearer {KEY}"}))
    try:
        assert "runs" in client.call("list_runs")
    finally:
        client.close()
    with pytest.raises(BaseExceptionGroup) as without_key:  # from the SDK's task groups
        Client(http(url))
    assert without_key.group_contains(  # the SDK's client shows the server's reason
        MCPError, match=r"^no bearer token was sent: send 'Authorization: Bearer KEY'")


def test_loopback_refuses_a_request_naming_another_host(start):
    url = start()
    foreign = httpx.post(url, json=INITIALIZE, headers={**HEADERS, "Host": "evil.example"})
    assert foreign.status_code == 421  # DNS rebinding: a page of evil.example reached 127.0.0.1
    ours = httpx.post(url, json=INITIALIZE, headers=HEADERS)
    assert ours.status_code == 200


@pytest.mark.parametrize(("argv", "expected"), [
    (["--transport", "http", "--host", "0.0.0.0"],
     "--host 0.0.0.0 lets other machines reach the server: give --api-key KEY"),
    (["--transport", "http", "--api-key", "two words"], "--api-key must be visible ASCII"),
    (["--transport", "http", "--port", "70000"], "--port 70000 is not a port number"),
    (["--api-key", KEY], "--api-key applies to --transport http"),
    (["--json"], "--json applies to --transport http"),
])
def test_unsafe_or_meaningless_options_are_refused_before_anything_starts(
        sqlite_url, capsys, argv, expected):
    assert cli_error(capsys, sqlite_url, "mcp", *argv).startswith(expected)


def test_a_missing_store_is_refused_not_created(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "store.db"
    assert cli_error(capsys, f"sqlite:///{missing}", "mcp").startswith("no kvtrace store at ")
    assert not missing.parent.exists()

