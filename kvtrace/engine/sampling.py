"""How a generation samples: the engine's parameters, as a recording states them.

Torch-free, so the CLI and the replay driver can name them without loading
the engine (`kvtrace/engine/__init__.py` loads its heavy modules on first use).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtrace.errors import UsageError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to generate: greedy (temperature 0) unless a recording says otherwise."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise UsageError(
                "sampling needs temperature >= 0, 0 < top_p <= 1 and max_new_tokens >= 1"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_recorded(
        cls, params: Mapping[str, Any] | None, *, default_max_new_tokens: int = 256
    ) -> SamplingParams:
        """The parameters a step was recorded with (OpenAI or transformers names)."""
        params = params or {}
        max_new = params.get("max_new_tokens", params.get("max_tokens"))
        temperature = params.get("temperature")
        top_p = params.get("top_p")
        seed = params.get("seed")
        return cls(
            temperature=float(temperature) if temperature is not None else 0.0,
            top_p=float(top_p) if top_p is not None else 1.0,
            seed=int(seed) if seed is not None else None,
            max_new_tokens=int(max_new) if max_new else default_max_new_tokens,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "max_new_tokens": self.max_new_tokens,
        }
