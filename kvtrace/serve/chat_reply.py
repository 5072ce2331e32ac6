"""A chat-completions answer of the local engine: the completion, its SSE chunks, its step.

The completion is OpenAI's `chat.completion`: the assistant message (its
`tool_calls` when the request offered tools), `finish_reason`, and `usage`
with `prompt_tokens_details.cached_tokens`, the prompt tokens the prefix
cache served. Streamed, it is apis/chat.py's chunks ending in `data:
[DONE]`. The step is a chat model_call whose usage also keeps `cached_tokens`
flat, the `finish_reason` and the generated token ids.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtrace.apis import ProviderApi, chat
from kvtrace.serve.generation import Generation, local_extra, recorded_params
from kvtrace.store.kinds import TOKEN_IDS_KEY

if TYPE_CHECKING:
    from kvtrace.serve.api import ChatRequest
    from kvtrace.serve.recording import StepWrite
    from kvtrace.store import Step
    from kvtrace.tracer.recorder import Recorder
    from kvtrace.tracer.redact import Redactor

class ChatReply:
    """The local engine's answer to a chat request (see the module docstring)."""

    def __init__(self, request: ChatRequest, generation: Generation, *, model: str) -> None:
        self.request = request
        self.generation = generation
        self.model = model
        self.finish_reason = "tool_calls" if generation.tool_calls else generation.finish_reason
        usage: dict[str, Any] = {
            "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": generation.completion_tokens,
            "total_tokens": generation.prompt_tokens + generation.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": generation.reused_tokens},
        }
        self.body: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": generation.message,
                         "finish_reason": self.finish_reason, "logprobs": None}],
            "usage": usage,
        }

    def events(self) -> Iterator[bytes]:
        return chat.stream_events(self.body, include_usage=self.request.includes_usage)

    def step(self, url: str, *, is_complete: bool = True) -> StepWrite:
        request, generation, completion = self.request, self.generation, self.body

        def write(recorder: Recorder, redactor: Redactor) -> Step:
            usage = {**completion["usage"], "cached_tokens": generation.reused_tokens,
                     "finish_reason": self.finish_reason,
                     TOKEN_IDS_KEY: list(generation.output_ids)}
            extra = local_extra(request, generation, url=redactor.url(url),
                                answered_by=self.model, is_complete=is_complete,
                                response={"id": completion["id"],
                                          "created": completion["created"]})
            return recorder.record_model_call(
                request.messages, completion, model=self.model, tools=request.tools,
                params=redactor.fields(
                    recorded_params(ProviderApi.OPENAI_CHAT, request.body, generation)),
                usage=usage, timings=generation.timings, extra=extra)

        return write
