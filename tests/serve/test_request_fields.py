"""The fields the three APIs name alike are read alike (serve/request.py `RequestFields`).

Each API's checked request reads `model`, `stream`, its token limit and
"no tool calls" from the body as sent; these pin what each one answers, so
that the one reading shared by all three keeps every API's own rule.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtrace.serve.anthropic_api import parse_messages_request
from kvtrace.serve.api import parse_chat_request
from kvtrace.serve.request import APIError
from kvtrace.serve.responses_api import parse_responses_request

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def _chat(**fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(json.dumps(body).encode(), is_local=False)


def _messages(**fields: Any) -> Any:
    body = {"model": "m", "max_tokens": 7, "messages": [{"role": "user", "content": "hi"}],
            **fields}
    return parse_messages_request(json.dumps(body).encode())


def _responses(**fields: Any) -> Any:
    body = {"model": "m", "input": "hi", **fields}
    return parse_responses_request(json.dumps(body).encode(), is_local=True)


def test_each_api_reads_its_own_token_limit():
    assert _chat(max_tokens=5).max_tokens == 5
    assert _chat(max_tokens=5, max_completion_tokens=9).max_tokens == 9
    assert _chat().max_tokens is None
    assert _messages().max_tokens == 7
    assert _responses(max_output_tokens=11).max_tokens == 11
    assert _responses(max_tokens=11).max_tokens is None  # not a Responses field


def test_a_null_max_completion_tokens_hides_max_tokens_as_before():
    assert _chat(max_tokens=5, max_completion_tokens=None).max_tokens is None


def test_model_and_stream_are_read_alike():
    for request in (_chat(stream=True), _messages(stream=True), _responses(stream=True)):
        assert request.model == "m"
        assert request.is_stream is True
    for request in (_chat(), _messages(), _responses()):
        assert request.is_stream is False
    assert parse_chat_request(b'{"messages": [{"role": "user", "content": "x"}]}',
                              is_local=False).model is None


def test_tool_choice_none_turns_tool_call_parsing_off_in_each_apis_words():
    assert _chat(tools=[TOOL]).parses_tool_calls
    assert not _chat(tools=[TOOL], tool_choice="none").parses_tool_calls
    assert not _chat().parses_tool_calls
    assert _responses(tools=[RESPONSES_TOOL]).parses_tool_calls
    assert not _responses(tools=[RESPONSES_TOOL], tool_choice="none").parses_tool_calls
    assert _messages(tools=[ANTHROPIC_TOOL]).parses_tool_calls
    assert not _messages(tools=[ANTHROPIC_TOOL],
                         tool_choice={"type": "none"}).parses_tool_calls


@pytest.mark.parametrize("parse", [_chat, _messages, _responses])
def test_a_bad_seed_is_the_same_400_in_every_api(parse):
    with pytest.raises(APIError) as error:
        parse(seed=2**64)
    assert (error.value.status, error.value.param, error.value.code) == (
        400, "seed", "invalid_value")
