"""Engine and two-tier KV prefix cache: load a model, prefill with reuse, generate.

    engine = load_engine()                        # embedded SmolLM2-135M-Instruct
    cache = open_cache(engine, disk_dir=default_cache_dir() / "kv")  # KVCache or StateCache
    ids = engine.chat_tokens([{"role": "user", "content": "hi"}])
    out = generate(engine, cache, ids, max_new_tokens=32)
    batcher = DecodeBatcher(engine, cache)        # the same, from many threads, decoded together

Layering: depends on torch/transformers and kvtrace.errors/paths only; never
on kvtrace.store, kvtrace.replay or kvtrace.cli.
"""

from kvtrace.engine.batch import DecodeBatcher
from kvtrace.engine.cache import DEFAULT_BLOCK_SIZE, KVCache, PrefixHit, TierStats
from kvtrace.engine.folders import build_tiny_model, default_model_dir
from kvtrace.engine.generate import GenerateOptions, GenerateResult, generate, generate_with, settle
from kvtrace.engine.layers import LayerKind, ModelLayout
from kvtrace.engine.model import Engine, load_engine
from kvtrace.engine.numerics import request_reproducible_gemm
from kvtrace.engine.prefill import PrefillResult, prefill
from kvtrace.engine.statecache import PrefixCache, StateCache, open_cache
from kvtrace.engine.tokenizer import ChatTokenizer, load_tokenizer

request_reproducible_gemm()  # before the engine computes anything (importing computes nothing)

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
