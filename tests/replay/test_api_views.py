"""One rule per API for the model's own turn: a response, and the same content sent back
as the next call's input, read as the same chat message (issue 41, item 3).

A real SQLite and PostgreSQL store (the `store` fixture); analyze with the byte tokenizer
must then find no prefix breaker where an agent sent its history back unchanged.
"""

from __future__ import annotations

import pytest

from kvtrace.replay.analyze import analyze
from kvtrace.store import ModelCall, ProviderApi
from tests.apis.test_apis import ANSWER, ASKED, RESULT_TURN, _anthropic_call

_R1 = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Plan."}]}
_R2 = {"type": "reasoning", "summary": []}
_FC = {"type": "function_call", "call_id": "call_9", "name": "shell", "arguments": "{}"}
_MSG = {"type": "message", "role": "assistant",
        "content": [{"type": "output_text", "text": "Looking."}]}
_MSG2 = {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Done looking."}]}


@pytest.mark.parametrize("output", [
    [_R1, _FC], [_FC, _MSG], [_FC, _R1], [_MSG, _MSG2], [_R1, _MSG, _FC, _R2, _MSG2],
    [_MSG, _R1, _FC],
], ids=["reasoning-call", "call-text", "call-reasoning", "two-texts", "mixed", "text-r-call"])
def test_a_responses_output_sent_back_as_input_reads_as_the_response(store, byte_tokenizer,
                                                                     output):
    """Issue 41, item 3: the next call's input is this call's input, its output items and the
    tool's output; the chat view (what templates render, what analyze compares) must give
    the response's message there, byte for byte, whatever the items' order."""
    run = store.run("codex")
    asked = [{"type": "message", "role": "user", "content": "List the files."}]
    first = ModelCall(run.record_model_call(asked, {"output": output, "status": "completed"},
                                            model="gpt-5", api=ProviderApi.OPENAI_RESPONSES))
    answer = {"type": "function_call_output", "call_id": "call_9", "output": "a.txt"}
    sent_back = [*asked, *output, answer] if _FC in output else [*asked, *output]
    second = ModelCall(run.record_model_call(sent_back, [_MSG2], model="gpt-5",
                                             api=ProviderApi.OPENAI_RESPONSES))
    assert second.messages[:2] == [*first.messages, first.response]
    assert analyze(store, "codex", byte_tokenizer).breakers == []


def test_an_anthropic_response_sent_back_reads_as_the_response(store, byte_tokenizer):
    first = ModelCall(_anthropic_call(store.run("claude")))
    second = ModelCall(_anthropic_call(store.run("claude"), messages=[
        *ASKED, {"role": "assistant", "content": ANSWER["content"]}, RESULT_TURN]))
    assert second.messages[:3] == [*first.messages, first.response]
    assert analyze(store, "claude", byte_tokenizer).breakers == []


def test_a_chat_response_sent_back_is_the_message_itself(store, byte_tokenizer):
    run = store.run("chat")
    asked = [{"role": "user", "content": "Weather in Oslo?"}]
    answer = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}
    first = ModelCall(run.record_model_call(asked, answer, model="m"))
    second = ModelCall(run.record_model_call(
        [*asked, answer, {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}], "Cold.",
        model="m"))
    assert second.messages[:2] == [*first.messages, first.response]
    assert analyze(store, "chat", byte_tokenizer).breakers == []
