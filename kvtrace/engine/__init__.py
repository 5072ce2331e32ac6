"""Engine and two-tier KV prefix cache: load a model, prefill with reuse, generate.

    engine = load_engine()                        # embedded SmolLM2-135M-Instruct
    cache = open_cache(engine, disk_dir=default_cache_dir() / "kv")  # KVCache or StateCache
    ids = engine.chat_tokens([{"role": "user", "content": "hi"}])
    out = generate(engine, cache, ids, max_new_tokens=32)
    batcher = DecodeBatcher(engine, cache)        # the same, from many threads, decoded together

Layering: depends on torch/transformers and kvtrace.errors/paths only; never
on kvtrace.store, kvtrace.replay or kvtrace.cli.

Importing the package loads no torch: each name below is imported from its
module on first use (PEP 562), so the torch-free parts (`sampling.py`, the
`SamplingParams` every replay and CLI path names; `numerics.py`) serve the
light install too. Importing it does set MKL's reproducible mode, which must
come before torch computes anything (numerics.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtrace.engine.numerics import request_reproducible_gemm
from kvtrace.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from kvtrace.engine.batch import DecodeBatcher
    from kvtrace.engine.cache import DEFAULT_BLOCK_SIZE, KVCache, PrefixHit, TierStats
    from kvtrace.engine.folders import build_tiny_model, default_model_dir
    from kvtrace.engine.generation import (
        GenerateOptions,
        GenerateResult,
        generate,
        generate_with,
        settle,
    )
    from kvtrace.engine.layers import LayerKind, ModelLayout
    from kvtrace.engine.model import Engine, load_engine
    from kvtrace.engine.prefilling import PrefillResult, prefill
    from kvtrace.engine.statecache import PrefixCache, StateCache, open_cache
    from kvtrace.engine.tokenizer import ChatTokenizer, load_tokenizer

request_reproducible_gemm()  # before the engine computes anything (importing computes nothing)

_HOMES = {
    "kvtrace.engine.batch": ("DecodeBatcher",),
    "kvtrace.engine.cache": ("DEFAULT_BLOCK_SIZE", "KVCache", "PrefixHit", "TierStats"),
    "kvtrace.engine.folders": ("build_tiny_model", "default_model_dir"),
    "kvtrace.engine.generation": ("GenerateOptions", "GenerateResult", "generate",
                                "generate_with", "settle"),
    "kvtrace.engine.layers": ("LayerKind", "ModelLayout"),
    "kvtrace.engine.model": ("Engine", "load_engine"),
    "kvtrace.engine.prefilling": ("PrefillResult", "prefill"),
    "kvtrace.engine.statecache": ("PrefixCache", "StateCache", "open_cache"),
    "kvtrace.engine.tokenizer": ("ChatTokenizer", "load_tokenizer"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


if not TYPE_CHECKING:  # mypy reads the imports above, so a misspelled name stays an error

    def __getattr__(name: str) -> Any:
        """A public name, imported from its module (and torch with it) on first use."""
        module = _HOME_OF.get(name)
        if module is None:
            raise AttributeError(f"module 'kvtrace.engine' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "ChatTokenizer",
    "DecodeBatcher",
    "Engine",
    "GenerateOptions",
    "GenerateResult",
    "KVCache",
    "LayerKind",
    "ModelLayout",
    "PrefillResult",
    "PrefixCache",
    "PrefixHit",
    "SamplingParams",
    "StateCache",
    "TierStats",
    "build_tiny_model",
    "default_model_dir",
    "generate",
    "generate_with",
    "load_engine",
    "load_tokenizer",
    "open_cache",
    "prefill",
    "settle",
]
