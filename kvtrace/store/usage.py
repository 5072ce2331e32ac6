"""What a model call's provider reported about tokens, read from `meta.usage` in one place.

Providers name their counts differently: OpenAI's `prompt_tokens` and
`prompt_tokens_details.cached_tokens` (kept flat as `cached_tokens` by
kvtrace and ATIF), Anthropic's `input_tokens` + `cache_read_input_tokens`.
A missing count is unknown, never zero. Used by `kvtrace analyze`, the
HTML report and the OTel export.
"""

from __future__ import annotations

from kvtrace.store.records import Step


def provider_usage(step: Step) -> tuple[int | None, int | None]:
    """(prompt tokens, cached tokens) the provider reported for a model call, when it did.

    Reads OpenAI's `prompt_tokens` and `cached_tokens` (flat, as kvtrace and
    ATIF keep them, or under `prompt_tokens_details`) and Anthropic's
    `input_tokens` + `cache_read_input_tokens`. A missing count is unknown,
    never zero.
    """
    usage = step.meta.get("usage")
    if not isinstance(usage, dict):
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = usage.get("cached_tokens")
    if cached is None and isinstance(details, dict):
        cached = details.get("cached_tokens")
    prompt = usage.get("prompt_tokens")
    if prompt is None and isinstance(usage.get("input_tokens"), int):
        read = usage.get("cache_read_input_tokens")
        prompt = usage["input_tokens"] + (read if isinstance(read, int) else 0)
        cached = read if cached is None else cached
    return (prompt if isinstance(prompt, int) else None,
            cached if isinstance(cached, int) else None)


def completion_tokens(step: Step) -> int | None:
    """The tokens the provider reported generating (OpenAI's or Anthropic's name), if it did."""
    usage = step.meta.get("usage")
    if not isinstance(usage, dict):
        return None
    for key in ("completion_tokens", "output_tokens"):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
