"""Per-model token prices, and what a model call cost with and without the provider's cache.

A prices file (JSON, or TOML when its name ends in `.toml`; docs/replay.md
shows both) maps model names to prices per million tokens, in whatever
currency it is written in:

    {"models": {"claude-sonnet-4-5": {"input": 3, "output": 15,
                                      "cache_read": 0.3, "cache_write": 3.75}}}

`input` and `output` are required; `cache_read` and `cache_write` default to
`input` (a provider that does not discount). A model is priced by its exact
name, else by the longest name in the file it starts with (so
`claude-sonnet-4-5` prices `claude-sonnet-4-5-20250929`).

The cost of a call reads its counts through `Usage` only (store/usage.py,
where every provider's names are normalised: prompt tokens are everything
the model read). As billed: the prompt tokens neither read from nor written
to the cache at the input price, cache reads at `cache_read`, cache writes
at `cache_write`, output at `output`. Without the cache: every prompt token
at the input price. A call whose provider reported no prompt count has no
cost (unknown is never 0).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.store import Usage

_REQUIRED = ("input", "output")
_OPTIONAL = ("cache_read", "cache_write")
PER_TOKENS = 1_000_000


@dataclass(frozen=True, slots=True)
class Price:
    """One model's prices per million tokens."""

    input: float
    output: float
    cache_read: float
    cache_write: float


@dataclass(frozen=True, slots=True)
class Cost:
    """What one model call cost as billed, and what it would have cost without the cache."""

    billed: float
    uncached: float

    @property
    def saved(self) -> float:
        return self.uncached - self.billed


@dataclass(frozen=True, slots=True)
class Costs:
    """A run's cost as billed and without the cache, over the calls that have a price."""

    num_calls: int  # calls priced
    billed: float
    uncached: float
    unpriced_models: list[str]  # models of calls with counts but no price in the list
    num_unknown: int  # calls whose provider reported no counts

    @property
    def saved(self) -> float:
        return self.uncached - self.billed

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_calls": self.num_calls,
            "billed": self.billed,
            "uncached": self.uncached,
            "saved": self.saved,
            "unpriced_models": self.unpriced_models,
            "num_unknown": self.num_unknown,
        }


@dataclass(frozen=True, slots=True)
class Prices:
    """Prices by model name (see the module docstring)."""

    models: Mapping[str, Price]

    def price(self, model: str | None) -> Price | None:
        """The price of `model`: by its exact name, else the longest name it starts with."""
        if not model:
            return None
        if model in self.models:
            return self.models[model]
        prefixes = [name for name in self.models if model.startswith(name)]
        return self.models[max(prefixes, key=len)] if prefixes else None

    def cost(self, model: str | None, usage: Usage) -> Cost | None:
        """The call's cost, or None when its model has no price or its prompt count is unknown."""
        price = self.price(model)
        if price is None or usage.prompt_tokens is None:
            return None
        read = usage.cached_tokens or 0
        write = usage.cache_write_tokens or 0
        output = usage.completion_tokens or 0
        fresh = max(0, usage.prompt_tokens - read - write)
        billed = (fresh * price.input + read * price.cache_read + write * price.cache_write
                  + output * price.output) / PER_TOKENS
        uncached = (usage.prompt_tokens * price.input + output * price.output) / PER_TOKENS
        return Cost(billed, uncached)


def parse_prices(document: Any, source: str = "the prices file") -> Prices:
    """Prices from a parsed JSON or TOML document; a UsageError names what is wrong."""
    models = document.get("models") if isinstance(document, Mapping) else None
    if not isinstance(models, Mapping) or not models:
        raise UsageError(f"{source} must map models to prices: {{\"models\": {{\"NAME\": "
                         "{\"input\": ..., \"output\": ...}}}} (per million tokens)",
                         param="prices")
    out = {}
    for name, entry in models.items():
        where = f"{source}: models.{name}"
        if not isinstance(entry, Mapping):
            raise UsageError(f"{where} must be an object of prices", param="prices")
        unknown = sorted(set(entry) - {*_REQUIRED, *_OPTIONAL})
        if unknown:
            raise UsageError(f"{where} has {unknown[0]!r}: the prices are input, output, "
                             "cache_read and cache_write", param="prices")
        values = {}
        for key in (*_REQUIRED, *_OPTIONAL):
            value = entry.get(key, entry.get("input") if key in _OPTIONAL else None)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 <= value < float("inf")):
                raise UsageError(f"{where}.{key} must be a price per million tokens "
                                 "(a number, 0 or more)", param="prices")
            values[key] = float(value)
        out[str(name)] = Price(**values)
    return Prices(out)


def read_prices(path: str | Path) -> Prices:
    """The prices file at `path` (TOML when its name ends in .toml, else JSON)."""
    path = Path(path)
    source = f"prices={path}"  # the CLI writes it as its flag: --prices PATH
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{source}: cannot read it ({exc.strerror or exc})",
                         param="prices") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"{source} is not UTF-8 text", param="prices") from exc
    try:
        document = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise UsageError(f"{source} is not {kind}: {exc}", param="prices") from exc
    return parse_prices(document, source)
