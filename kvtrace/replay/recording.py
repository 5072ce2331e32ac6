"""How a model call lives in a trace, read back as token ids.

A recorded model call holds the chat `messages`, the request's `tools` and
the `response` (an assistant message, maybe with `tool_calls`; a plain string
in steps recorded before the function-calling format). Prompts and outputs
are token ids of one rendering (kvtrace.rendering): the response's
text is what the model says for it there, tool calls included. When kvtrace itself generated the
response (continue, the example, the benchmark), the model call's `output_ids`
(kept in its usage) also hold the exact tokens generated: re-tokenising the response text may
give other ids (BPE is not a bijection on generated sequences), and only the
generated ids are what a cache saw.

`expected_output_ids` prefers those recorded ids, but only after checking that
they decode to the recorded text, so ids from another tokenizer are never
used. Otherwise it derives the output's tokens from the chat template (the
tokens the next prompt will contain), which any tokenizer can do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtrace.engine.sampling import SamplingParams
from kvtrace.errors import ReplayError
from kvtrace.rendering import assistant_text, content_text, id_seed, parse_assistant_text
from kvtrace.replay.backend import CallResult, Message, Tokenizer
from kvtrace.store import Run, Step
from kvtrace.store.kinds import TOKEN_IDS_KEY, ModelCall


def response_message(step: Step) -> Message:
    """The assistant message a model call returned (a plain-string response as its text)."""
    response = ModelCall(step).response
    if isinstance(response, str):
        return assistant_message(response)
    if isinstance(response, Mapping):
        return dict(response)
    raise ReplayError(
        f"step {step.short_id} has a response kvtrace cannot read: {type(response).__name__}"
    )


def response_text(step: Step) -> str:
    """What the model said for a model call's response: its text, then its tool calls."""
    return assistant_text(response_message(step))


def step_messages(step: Step) -> list[Message]:
    """The chat messages a model call sent."""
    call = ModelCall(step)
    if not call.has_messages:
        raise ReplayError(f"model call {step.short_id} has no list of messages to replay")
    return call.messages


def step_tools(step: Step) -> list[Message] | None:
    """The tool definitions a model call sent, if any."""
    return ModelCall(step).tools


def prompt_ids(tokenizer: Tokenizer, step: Step) -> list[int]:
    """The token ids of a recorded model call's prompt (messages and tools)."""
    return tokenizer.chat_tokens(step_messages(step), tools=step_tools(step))


def assistant_message(text: str) -> Message:
    return {"role": "assistant", "content": text}


def expected_output_ids(
    step: Step, tokenizer: Tokenizer, prompt_ids: Sequence[int]
) -> list[int]:
    """The output tokens of a recorded model call (see the module docstring)."""
    recorded = ModelCall(step).output_ids
    if recorded is not None and _decodes_to(tokenizer, recorded, step):
        return recorded
    return templated_output_ids(tokenizer, step_messages(step), response_message(step),
                                prompt_ids, tools=step_tools(step))


def templated_output_ids(
    tokenizer: Tokenizer,
    messages: list[Message],
    response: Message | str,
    prompt_ids: Sequence[int],
    *,
    tools: list[Message] | None = None,
) -> list[int]:
    """The tokens the chat template puts after the prompt for a `response`.

    They run up to and including the end-of-turn token, which is where a
    generation that stopped on it ends too. Returns [] when the template does
    not extend the prompt (some templates rewrite earlier turns).
    """
    message = assistant_message(response) if isinstance(response, str) else response
    full = tokenizer.chat_tokens([*messages, message], add_generation_prompt=False, tools=tools)
    if full[: len(prompt_ids)] != list(prompt_ids):
        return []
    tail = full[len(prompt_ids) :]
    stops = set(tokenizer.eos_token_ids)
    ends = [i for i, token in enumerate(tail) if token in stops]
    return tail[: ends[-1] + 1] if ends else tail


def context_limit(tokenizer: Tokenizer, num_tokens: int) -> int | None:
    """The model's context when `num_tokens` do not fit it, else None."""
    limit = getattr(tokenizer, "max_context_tokens", None)
    return limit if limit is not None and num_tokens > limit else None


def check_context(tokenizer: Tokenizer, step: Step, prompt_tokens: int,
                  response_tokens: int) -> str | None:
    """Why step `step`'s prompt and response do not fit the model's context, or None."""
    limit = context_limit(tokenizer, prompt_tokens + response_tokens)
    if limit is None:
        return None
    return (f"step @{step.depth} ({step.short_id}) needs "
            f"{prompt_tokens + response_tokens:,} tokens (prompt {prompt_tokens:,} + response "
            f"{response_tokens:,}), more than the model's context of {limit:,}")


def record_generation(
    run: Run,
    messages: list[Message],
    result: CallResult,
    *,
    model: str,
    params: SamplingParams,
    timings: Mapping[str, float] | None = None,
    tools: list[Message] | None = None,
) -> Step:
    """Record a model call that a backend generated, with its exact token ids.

    In a function-calling run (`tools` not None, maybe empty), the text is read
    for tool calls (rendering.parse_assistant_text) and recorded as an
    assistant message with `tool_calls`.
    """
    usage: dict[str, Any] = {  # what the backend did not report is left out, never guessed
        "prompt_tokens": None if result.is_usage_missing else result.prompt_tokens,
        "completion_tokens": len(result.output_ids) if result.output_ids is not None else None,
        "cached_tokens": result.reused_tokens,
        "finish_reason": result.finish_reason,
    }
    if result.output_ids is not None:
        usage[TOKEN_IDS_KEY] = list(result.output_ids)
    recorded = params.to_dict()
    if recorded["seed"] is None and result.seed is not None:
        recorded["seed"] = result.seed  # a fresh random seed: keep it, or verify cannot work
    response = (parse_assistant_text(result.text, id_seed=id_seed(messages))
                if tools is not None else assistant_message(result.text))
    return run.record_model_call(
        messages,
        response,
        model=model,
        tools=tools or None,
        params=recorded,
        usage={k: v for k, v in usage.items() if v is not None},
        timings=dict(timings) if timings else {
            "prefill_s": round(result.prefill_s, 4), "decode_s": round(result.decode_s, 4)
        },
    )


def output_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of generated token ids, without the stop token that ended them."""
    stops = set(tokenizer.eos_token_ids)
    body = ids[:-1] if ids and ids[-1] in stops else ids
    return tokenizer.decode(body)


def _decodes_to(tokenizer: Tokenizer, ids: list[int], step: Step) -> bool:
    """Whether recorded ids are this response's tokens in this tokenizer.

    They are when they decode to the response's text, or, for a response with
    tool calls, to a text that reads back as the same message (a model may
    write text after its tool call, which the rendering puts first).
    """
    text = output_text(tokenizer, ids)
    response = response_message(step)
    if text == assistant_text(response):
        return True
    if not response.get("tool_calls"):
        return False
    parsed = parse_assistant_text(text)
    return content_text(parsed.get("content")) == content_text(response.get("content")) and [
        c["function"] for c in parsed.get("tool_calls", [])
    ] == [c.get("function") for c in response["tool_calls"]]
