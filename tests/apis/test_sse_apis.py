"""The Anthropic and Responses stream readers and writers (anthropic.py, responses.py):
what a stream adds up to, and the outcomes of streams that are not whole."""

from __future__ import annotations

import json

import pytest

from kvtrace.apis import anthropic, responses

MESSAGE = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
    "content": [
        {"type": "thinking", "thinking": "First, the weather.", "signature": "c2lnbmF0dXJl"},
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy"},
        {"type": "text", "text": "Per the report, it is sunny.",
         "citations": [{"type": "char_location", "cited_text": "sunny", "document_index": 0,
                        "start_char_index": 0, "end_char_index": 5}]},
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
         "input": {"query": "Paris weather"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Paris", "days": [1, 2]}},
    ],
    "stop_reason": "tool_use", "stop_sequence": None,
    "usage": {"input_tokens": 10, "cache_creation_input_tokens": 4,
              "cache_read_input_tokens": 100, "output_tokens": 42},
}
RESPONSE = {
    "id": "resp_1", "object": "response", "created_at": 1, "model": "gpt-x",
    "status": "completed", "instructions": "Be brief.",
    "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Hm"}],
         "encrypted_content": "gAAAA"},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Sunny.", "annotations": []},
                     {"type": "refusal", "refusal": "Not that."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city":"Paris"}', "status": "completed"},
        {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_2", "name": "patch",
         "input": "*** Begin Patch"},
    ],
    "usage": {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 16},
              "output_tokens": 9},
}


def event(data: dict) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


@pytest.mark.parametrize(("module", "response"), [(anthropic, MESSAGE),
                                                  (responses, RESPONSE)],
                         ids=["anthropic", "responses"])
def test_a_written_stream_adds_up_to_the_response_it_was_written_from(module, response):
    assembled = module.assemble(module.stream_bytes(response))
    assert assembled.response == response
    assert assembled.is_finished and assembled.error is None and not assembled.unknown_events


def test_anthropic_usage_of_message_delta_replaces_the_starts_counts_key_by_key():
    stream = b"".join(event(e) for e in [
        {"type": "message_start", "message": {"id": "m", "role": "assistant", "content": [],
                                              "usage": {"input_tokens": 5, "output_tokens": 1}}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
         "usage": {"output_tokens": 7}},
        {"type": "message_stop"}])
    assembled = anthropic.assemble(stream)
    assert assembled.response["usage"] == {"input_tokens": 5, "output_tokens": 7}
    assert assembled.response["stop_reason"] == "end_turn"


def test_anthropic_unknown_events_and_deltas_are_skipped_and_named():
    stream = b"".join(event(e) for e in [
        {"type": "message_start", "message": {"id": "m", "role": "assistant", "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text",
                                                                      "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "sparkle_delta"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta",
                                                              "text": "hi"}},
        {"type": "aurora", "index": 0},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_stop"}])
    assembled = anthropic.assemble(stream)
    assert assembled.unknown_events == ("content_block_delta.sparkle_delta", "aurora")
    assert assembled.response["content"] == [{"type": "text", "text": "hi"}]


def test_anthropic_error_event_ends_the_stream_with_its_error():
    stream = b"".join(event(e) for e in [
        {"type": "message_start", "message": {"id": "m", "role": "assistant", "content": []}},
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}])
    assembled = anthropic.assemble(stream)
    assert assembled.error == {"type": "overloaded_error", "message": "Overloaded"}
    assert not assembled.is_finished


def test_a_last_event_cut_in_the_middle_is_dropped_and_the_stream_unfinished():
    whole = anthropic.stream_bytes(MESSAGE)
    cut = whole[:whole.index(b'"partial_json"') + 20]
    assembled = anthropic.assemble(cut)
    assert not assembled.is_finished
    # The server tool's block had started, but no piece of its input had arrived whole.
    assert [b["type"] for b in assembled.response["content"]] == [
        "thinking", "redacted_thinking", "text"]


@pytest.mark.parametrize("events", [
    [{"type": "content_block_start", "index": 0, "content_block": {"type": "text"}}],
    [{"type": "message_start", "message": {"role": "assistant"}},
     {"type": "content_block_delta", "index": 3, "delta": {"type": "text_delta", "text": "x"}}],
    [{"type": "message_start", "message": {"role": "assistant"}},
     {"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use"}},
     {"type": "content_block_delta", "index": 0,
      "delta": {"type": "input_json_delta", "partial_json": "{oops"}},
     {"type": "content_block_stop", "index": 0}],
], ids=["no message_start", "delta before its block", "tool input not JSON"])
def test_anthropic_streams_out_of_order_or_malformed_raise_value_error(events):
    with pytest.raises(ValueError):
        anthropic.assemble(b"".join(event(e) for e in events))


def test_a_responses_stream_cut_before_its_terminal_event_has_the_items_so_far():
    whole = responses.stream_bytes(RESPONSE)
    cut = whole[:whole.index(b"response.function_call_arguments.done")]
    assembled = responses.assemble(cut)
    assert not assembled.is_finished
    output = assembled.response["output"]
    assert [i["type"] for i in output] == ["reasoning", "message", "function_call"]
    assert output[2]["arguments"] == '{"city":"Paris"}' and output[2]["status"] == "in_progress"
    assert assembled.response["status"] == "in_progress"


def test_responses_events_outside_the_family_are_named_and_its_error_event_ends_it():
    head = {"type": "response.created", "sequence_number": 0,
            "response": {"id": "r", "status": "in_progress", "output": []}}
    stream = b"".join(event(e) for e in [
        head, {"type": "rate_limits.updated", "sequence_number": 1},
        {"type": "response.web_search_call.searching", "sequence_number": 2},
        {"type": "error", "sequence_number": 3, "code": "server_error", "message": "boom"}])
    assembled = responses.assemble(stream)
    assert assembled.unknown_events == ("rate_limits.updated",)
    assert assembled.error == {"code": "server_error", "message": "boom"}


@pytest.mark.parametrize("events", [
    [{"type": "response.created", "sequence_number": 3, "response": {"output": []}},
     {"type": "response.in_progress", "sequence_number": 3, "response": {"output": []}}],
    [{"type": "response.created", "sequence_number": 0, "response": {"output": []}},
     {"type": "response.output_text.delta", "sequence_number": 1, "output_index": 0,
      "content_index": 0, "delta": "x"}],
    [{"type": "response.output_item.added", "sequence_number": 0, "output_index": 0,
      "item": {"type": "message"}}],
], ids=["sequence number repeated", "delta before its item", "no response.created"])
def test_responses_streams_out_of_order_raise_value_error(events):
    with pytest.raises(ValueError):
        responses.assemble(b"".join(event(e) for e in events))
