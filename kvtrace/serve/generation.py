"""What the local engine is asked and what it made, whatever API the request was spoken in.

Local mode answers three APIs (chat completions, Anthropic Messages, OpenAI
Responses) with one engine and one rule for prompts: each API's checked
request is a `LocalCall`, which says what to render (the conversation and
tools in OpenAI chat shape, exactly as the store's chat view will read the
recorded call back, so a replay renders the same tokens) and how to sample;
the engine's answer is a `Generation`, API-neutral (the text, the assistant
message parsed from it, the counts). Each API turns a Generation into its
own `Reply`: the JSON answer, the same answer as that API's SSE events, and
the step that records it.

`local_extra` is what every local answer records in `extra`, whichever
API: the HTTP facts, the response's own ids, the model name the request
asked for when another model answered (`request_model`), the chosen seed.
`native_step` is how an answer in a provider's own API (Messages,
Responses) is recorded: one rule, so the two APIs' steps cannot drift apart
(their streams are written by each API's module, kvtrace/apis/).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtrace.apis import ProviderApi, request_params, stored_fields
from kvtrace.store.kinds import STREAM_FIELD, TOKEN_IDS_KEY
from kvtrace.store.objects.encoding import canonical_json
from kvtrace.tracer.endpoints import Endpoint, response_fields

if TYPE_CHECKING:
    from kvtrace.serve.recording import StepWrite
    from kvtrace.store import Step
    from kvtrace.tracer.recorder import Recorder
    from kvtrace.tracer.redact import Redactor

SERVED_BY = "kvtrace serve (local)"


class LocalCall(Protocol):
    """A checked request, as the engine sees it."""

    @property
    def body(self) -> dict[str, Any]:
        """The JSON body as sent (sampling fields are read from it: temperature, top_p, seed)."""

    @property
    def model(self) -> str | None:
        """The model name the request asked for."""

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation to render, in OpenAI chat shape."""

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The tool definitions to render, in OpenAI chat shape."""

    @property
    def is_stream(self) -> bool: ...

    @property
    def max_tokens(self) -> int | None: ...

    @property
    def stop(self) -> list[str]: ...

    @property
    def parses_tool_calls(self) -> bool:
        """Whether `<tool_call>` blocks in the output become the API's tool calls."""


@dataclass(frozen=True, slots=True)
class Generation:
    """What the engine made for one call (API-neutral).

    `text` is the output, cut at the first stop string (`stop_sequence`
    names it); `message` is the assistant message read from it in chat shape
    (`tool_calls` when the call parses them); `finish_reason` is how the
    text ended: "stop" (the model's end, or a stop string) or "length" (the
    token limit). Each API says "tool calls" in its own words.
    """

    text: str
    message: dict[str, Any]
    finish_reason: str
    stop_sequence: str | None
    prompt_tokens: int
    reused_tokens: int
    output_ids: list[int]
    chosen_seed: int | None  # the seed the server chose (the request sampled and sent none)
    timings: dict[str, float]

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls") or [])


class Reply(Protocol):
    """One API's answer to a call: its JSON body, its SSE events, its step."""

    @property
    def body(self) -> dict[str, Any]: ...

    def events(self) -> Iterator[bytes]:
        """The body as the API's SSE stream; the last event is the stream's end."""

    def step(self, url: str, *, is_complete: bool = True) -> StepWrite:
        """How the answer is recorded (`is_complete=False`: a stream the client dropped)."""


class NativeReply(Reply, Protocol):
    """A Reply in a provider's own API: what `native_step` records of it."""

    @property
    def request(self) -> LocalCall: ...

    @property
    def generation(self) -> Generation: ...

    @property
    def model(self) -> str:
        """The model that answered."""

    @property
    def usage(self) -> dict[str, Any]:
        """The answer's usage, in the API's own terms."""


def stored_call(api: ProviderApi, conversation: Any, system: Any, tools: Any, *,
                prior: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A request's conversation, system prompt and tools as a step of `api` stores them, and
    as the store gives them back: its layout (apis/__init__.py), keys sorted as in its
    canonical JSON. A conversation is rendered from this form, so that the prompt of a
    live request and of its recording are the same tokens (a tool-use `input` object is
    rendered as JSON in key order). UsageError when the store would refuse them; `prior`
    (Responses): calls made before the input that the step does not hold.
    """
    payload, lists = stored_fields(api, conversation, [], tools=tools, system=system,
                                   prior=prior)
    payload.pop("response", None)  # none yet: only what was asked is rendered
    return dict(json.loads(canonical_json({**payload, **lists})))


def local_extra(call: LocalCall, generation: Generation, *, url: str, answered_by: str,
                response: dict[str, Any], is_complete: bool) -> dict[str, Any]:
    """The `extra` of a local answer's step (see the module docstring); `url` is redacted."""
    extra: dict[str, Any] = {
        "http": {"url": url, "status": 200, "stream": call.is_stream, "complete": is_complete},
        "response": response,
        "served_by": SERVED_BY,
    }
    if call.model is not None and call.model != answered_by:
        extra["request_model"] = call.model
    if generation.chosen_seed is not None:
        extra["seed_chosen"] = True
    return extra


def recorded_params(api: ProviderApi, body: dict[str, Any],
                    generation: Generation) -> dict[str, Any]:
    """The request's parameters as the tracer records them, with the seed the server chose."""
    params = request_params(api, body)
    if generation.chosen_seed is not None:
        params["seed"] = generation.chosen_seed
    return params


def native_step(reply: NativeReply, url: str, *, is_complete: bool, endpoint: Endpoint,
                conversation: list[dict[str, Any]], system: Any,
                tools: list[dict[str, Any]] | None,
                finish_reason: Callable[[Mapping[str, Any]], Any]) -> StepWrite:
    """How a Messages or Responses answer is recorded: the request in its stored form
    (`conversation`, `system`, `tools`), the answer split as the tracer splits a response
    (endpoints.py), its usage with the finish reason and token ids, and the stream sent."""
    request, generation, response = reply.request, reply.generation, reply.body

    def write(recorder: Recorder, redactor: Redactor) -> Step:
        usage = {**reply.usage, "finish_reason": finish_reason(response),
                 TOKEN_IDS_KEY: list(generation.output_ids)}
        own, settings = response_fields(endpoint, response)
        extra = local_extra(request, generation, url=redactor.url(url), answered_by=reply.model,
                            is_complete=is_complete, response=own)
        stream = b"".join(reply.events()) if request.is_stream else None
        return recorder.record_model_call(
            conversation, response, model=reply.model, tools=tools,
            params=redactor.fields(recorded_params(endpoint.api, request.body, generation)),
            usage=usage, timings=generation.timings, extra=extra, api=endpoint.api,
            system=system, raw={STREAM_FIELD: stream} if stream is not None else None,
            response_settings=redactor.fields(settings) or None)

    return write
