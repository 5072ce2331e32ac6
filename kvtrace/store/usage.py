"""What a provider reported about tokens, normalised in one place (`Usage.parse`).

A model call keeps its provider's `usage` as the provider sent it; every
reader goes through `Usage.parse`, which knows each provider's names:

- OpenAI chat completions (and vLLM, SGLang, llama.cpp, ATIF, kvtrace's own
  records): `prompt_tokens`, `completion_tokens`, cached tokens under
  `prompt_tokens_details.cached_tokens` (kept flat as `cached_tokens` too);
  DeepSeek adds `prompt_cache_hit_tokens`. Cached tokens are counted inside
  `prompt_tokens`.
- OpenAI Responses: `input_tokens` (cached ones inside it), `output_tokens`,
  `input_tokens_details.cached_tokens`; Codex's rollouts flatten the same
  counts to `cached_input_tokens` (and, lately, `cache_write_input_tokens`).
- Anthropic Messages: `input_tokens` *excludes* cache reads and writes, so
  everything the model read is `input_tokens + cache_creation_input_tokens +
  cache_read_input_tokens`. Adding them the wrong way mis-prices cached
  tokens several times over, which is why there is one parser.

`prompt_tokens` is always everything the model read. A count the provider
did not send is None (unknown), never 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Where each provider keeps its cache reads, most specific first.
_CACHED_PATHS = (
    ("cached_tokens",),
    ("prompt_tokens_details", "cached_tokens"),
    ("input_tokens_details", "cached_tokens"),
    ("cached_input_tokens",),
    ("cache_read_input_tokens",),
    ("prompt_cache_hit_tokens",),
)


@dataclass(frozen=True, slots=True)
class Usage:
    """A model call's token counts in one vocabulary (None: not reported)."""

    prompt_tokens: int | None = None  # everything the model read, cache reads and writes included
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens read from the provider's cache
    cache_write_tokens: int | None = None  # prompt tokens written to it (Anthropic, Codex)
    finish_reason: str | None = None

    @classmethod
    def parse(cls, raw: Any) -> Usage:
        """The normalised counts of a provider's `usage` object (see the module docstring)."""
        if not isinstance(raw, Mapping):
            return cls()
        cached = next((value for path in _CACHED_PATHS
                       if (value := _count(_at(raw, path))) is not None), None)
        write = _count(raw.get("cache_creation_input_tokens"))
        if write is None:
            write = _count(raw.get("cache_write_input_tokens"))
        prompt = _count(raw.get("prompt_tokens"))
        if prompt is None and (given := _count(raw.get("input_tokens"))) is not None:
            is_anthropic = ("cache_read_input_tokens" in raw
                            or "cache_creation_input_tokens" in raw)
            read = _count(raw.get("cache_read_input_tokens")) or 0
            prompt = given + read + (write or 0) if is_anthropic else given
        completion = _count(raw.get("completion_tokens"))
        if completion is None:
            completion = _count(raw.get("output_tokens"))
        finish = raw.get("finish_reason")
        return cls(prompt, completion, cached, write, finish if isinstance(finish, str) else None)

    @property
    def computed_tokens(self) -> int | None:
        """Prompt tokens the provider did not read from its cache, when both counts are known."""
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "finish_reason": self.finish_reason,
        }


def _at(raw: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = raw
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
