"""How a model call lives in a trace, read back as token ids.

A recorded model call holds the chat `messages` and the `response` (an
assistant message or a plain string). When kvtrace itself generated the
response (continue, the example, the benchmark), `usage.completion_token_ids`
also holds the exact tokens generated: re-tokenising the response text may
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

from kvtrace.errors import ReplayError
from kvtrace.replay.backend import CallResult, Message, SamplingParams, Tokenizer
from kvtrace.store import Run, Step

TOKEN_IDS_KEY = "completion_token_ids"


def response_text(step: Step) -> str:
    """The text of a model call's response."""
    response = step.content.get("response")
    if isinstance(response, str):
        return response
    if isinstance(response, Mapping):
        content = response.get("content")
        if isinstance(content, str):
            return content
        if content is None:
            return ""
        if isinstance(content, list):  # OpenAI content parts
            return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    raise ReplayError(
        f"step {step.short_id} has a response kvtrace cannot read as text: "
        f"{type(response).__name__}"
    )


def step_messages(step: Step) -> list[Message]:
    """The chat messages a model call sent."""
    messages = step.content.get("messages")
    if not isinstance(messages, list):
        raise ReplayError(f"model call {step.short_id} has no list of messages to replay")
    return [dict(m) for m in messages]


def assistant_message(text: str) -> Message:
    return {"role": "assistant", "content": text}


def expected_output_ids(
    step: Step, tokenizer: Tokenizer, prompt_ids: Sequence[int]
) -> list[int]:
    """The output tokens of a recorded model call (see the module docstring)."""
    text = response_text(step)
    recorded = _recorded_ids(step)
    if recorded is not None and _decodes_to(tokenizer, recorded, text):
        return recorded
    return templated_output_ids(tokenizer, step_messages(step), text, prompt_ids)


def templated_output_ids(
    tokenizer: Tokenizer, messages: list[Message], text: str, prompt_ids: Sequence[int]
) -> list[int]:
    """The tokens the chat template puts after the prompt for a response `text`.

    They run up to and including the end-of-turn token, which is where a
    generation that stopped on it ends too. Returns [] when the template does
    not extend the prompt (some templates rewrite earlier turns).
    """
    full = tokenizer.chat_tokens([*messages, assistant_message(text)], add_generation_prompt=False)
    if full[: len(prompt_ids)] != list(prompt_ids):
        return []
    tail = full[len(prompt_ids) :]
    stops = set(tokenizer.eos_token_ids)
    ends = [i for i, token in enumerate(tail) if token in stops]
    return tail[: ends[-1] + 1] if ends else tail


def record_generation(
    run: Run,
    messages: list[Message],
    result: CallResult,
    *,
    model: str,
    params: SamplingParams,
    timings: Mapping[str, float] | None = None,
) -> Step:
    """Record a model call that a backend generated, with its exact token ids."""
    usage: dict[str, Any] = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids) if result.output_ids is not None else None,
        "cached_tokens": result.reused_tokens,
        "finish_reason": result.finish_reason,
    }
    if result.output_ids is not None:
        usage[TOKEN_IDS_KEY] = list(result.output_ids)
    recorded = params.to_dict()
    if recorded["seed"] is None and result.seed is not None:
        recorded["seed"] = result.seed  # a fresh random seed: keep it, or verify cannot work
    return run.record_model_call(
        messages,
        assistant_message(result.text),
        model=model,
        params=recorded,
        usage={k: v for k, v in usage.items() if v is not None},
        timings=dict(timings) if timings else {
            "prefill_s": round(result.prefill_s, 4), "decode_s": round(result.decode_s, 4)
        },
    )


def _recorded_ids(step: Step) -> list[int] | None:
    usage = step.meta.get("usage")
    if not isinstance(usage, Mapping):
        return None
    ids = usage.get(TOKEN_IDS_KEY)
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        return None
    return list(ids)


def output_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of generated token ids, without the stop token that ended them."""
    stops = set(tokenizer.eos_token_ids)
    body = ids[:-1] if ids and ids[-1] in stops else ids
    return tokenizer.decode(body)


def _decodes_to(tokenizer: Tokenizer, ids: list[int], text: str) -> bool:
    return output_text(tokenizer, ids) == text
