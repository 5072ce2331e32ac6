"""What the local model cannot read, and tool answers, under one rule on all three routes
(issue 41, item 5).

A real server on a loopback port, a real store on SQLite and PostgreSQL (the
`store` fixture), the tiny random model in local mode; the canned upstreams
of tests/canned.py and tests/serve/canned_proxied.py in upstream mode.
"""

from __future__ import annotations

import json

import httpx
import pytest

PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAA"
       "BJRU5ErkJggg==")  # a 1x1 PNG


def image_request(route: str, model: str) -> tuple[str, dict]:
    """A question about an image, in the words of `route`'s API: (path, body)."""
    if route == "chat":
        return "/chat/completions", {"model": model, "max_tokens": 2, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]}
    if route == "anthropic":
        return "/messages", {"model": model, "max_tokens": 2, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": PNG}}]}]}
    return "/responses", {"model": model, "max_output_tokens": 16, "input": [
        {"role": "user", "content": [
            {"type": "input_text", "text": "What is in this picture?"},
            {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}]}]}


def orphan_tool_answer(route: str, model: str) -> tuple[str, dict]:
    """A tool's answer to a call no earlier assistant turn made, in `route`'s words."""
    if route == "chat":
        return "/chat/completions", {"model": model, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "tool", "tool_call_id": "call_nobody_made", "content": "5"}]}
    if route == "anthropic":
        return "/messages", {"model": model, "max_tokens": 2, "messages": [
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_nobody_made", "content": "5"}]}]}
    return "/responses", {"model": model, "max_output_tokens": 16, "input": [
        {"role": "user", "content": "Add 2 and 3."},
        {"type": "function_call_output", "call_id": "call_nobody_made", "output": "5"}]}


ROUTES = ["chat", "anthropic", "responses"]


@pytest.mark.parametrize("route", ROUTES)
def test_the_local_model_refuses_an_image_it_cannot_read_and_records_nothing(
        store, serve_local, tiny_engine, route):
    server = serve_local(store, run="looked")
    path, body = image_request(route, tiny_engine.name)
    reply = httpx.post(server.url + path, json=body, timeout=120)
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert "reads text only" in error["message"] and "--upstream" in error["message"]
    assert store.runs() == []


@pytest.mark.parametrize("route", ROUTES)
def test_upstream_mode_passes_the_image_on(store, serve_upstream, canned_upstream, canned_apis,
                                           route):
    upstream = canned_upstream if route == "chat" else canned_apis
    proxy = serve_upstream(store, upstream.url, run="passed")
    path, body = image_request(route, "canned-model")
    reply = httpx.post(proxy.url + path, json=body, timeout=60)
    assert reply.status_code == 200, reply.text[:300]
    sent = json.loads(upstream.seen[-1]["body"])
    assert PNG in json.dumps(sent)  # forwarded as the client sent it


@pytest.mark.parametrize("route", ROUTES)
def test_a_tool_answer_to_no_call_is_a_400_on_every_route(store, serve_local, tiny_engine,
                                                          route):
    server = serve_local(store, run="orphan")
    path, body = orphan_tool_answer(route, tiny_engine.name)
    reply = httpx.post(server.url + path, json=body, timeout=120)
    assert reply.status_code == 400, reply.text[:300]
    assert "nobody_made" in reply.json()["error"]["message"]
    assert store.runs() == []
