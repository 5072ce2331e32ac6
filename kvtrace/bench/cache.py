"""Cache benchmark: cold prefill vs the same prompt's prefix from memory, from disk.

Cases, side by side in one process on one engine (the default model unless
given), each on a 2,048-token prompt of random token ids:

- cold: `prefill` with no cache (every token computed canonically);
- memory hit: the prompt plus `num_new` new tokens, prefix in the memory tier;
- disk hit: the same, after a new `KVCache` on the same disk folder (memory
  empty; the OS page cache is warm, as it is for a recent run);
- tree hit: a memory hit with the live sequence dropped first, so the
  prefix is assembled from the radix tree (what a prompt pays when the
  previous call was on another branch);
- live forward: what a hit is measured against, a plain forward of the same
  `num_new` tokens on a transformers DynamicCache already holding the
  prefix (no lookup, no padding, no storing; cropped back after each run).
  `hit_overhead_ms` = memory hit - live forward (medians), the per-call cost
  of the cache machinery; each live forward runs right before its hit.

Timings are medians of `repeats` runs; each hit run starts from the same
state (the new tokens' KV is dropped again by using fresh new tokens).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def run_cache_bench(
    *,
    cache_dir: str | os.PathLike[str],
    model: str | None = None,
    num_tokens: int = 2048,
    num_new: int = 32,
    repeats: int = 3,
    seed: int = 0,
    family: str | None = None,
) -> dict[str, Any]:
    """Measure cold vs memory-hit vs disk-hit prefill; return one JSON-able dict.

    `family`: a tiny random model of that family (families.py), written under
    `cache_dir/families/`; a model with window or state layers is measured by
    `run_state_cache_bench`.
    """
    import torch

    from kvtrace.engine import load_engine, open_cache, prefill

    if family is not None:
        from kvtrace.engine import default_model_dir
        from kvtrace.engine.families import write_family

        model = str(write_family(family, Path(cache_dir) / "families" / family,
                                 tokenizer_dir=default_model_dir(Path(cache_dir))))
    engine = load_engine(model, cache_dir=cache_dir)
    if not engine.layout.is_plain:
        from kvtrace.bench.statecache import run_state_cache_bench

        return run_state_cache_bench(engine, num_tokens=num_tokens, num_new=num_new,
                                     repeats=repeats, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    prompt = torch.randint(100, vocab, (num_tokens,), generator=generator).tolist()
    tails = [
        torch.randint(100, vocab, (num_new,), generator=generator).tolist()
        for _ in range(3 * repeats)
    ]
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-cache-") as tmp:
        disk_dir = Path(tmp) / "kv"
        colds = [prefill(engine, None, prompt) for _ in range(repeats)]
        cold = [result.seconds for result in colds]
        live_kv = colds[-1].kv
        del colds
        warm = open_cache(engine, disk_dir=disk_dir)
        started = time.perf_counter()
        first = prefill(engine, warm, prompt)  # a miss: computes and stores both tiers
        populate_s = time.perf_counter() - started
        mem, live = [], []
        for tail in tails[:repeats]:
            live.append(_live_forward(engine, live_kv, tail))
            result = prefill(engine, warm, prompt + tail)
            _expect(result.num_memory_tokens == num_tokens, "memory hit", result)
            mem.append(result.seconds)
        tree = []
        for tail in tails[2 * repeats :]:
            warm.drop_live()
            result = prefill(engine, warm, prompt + tail)
            _expect(result.num_memory_tokens == num_tokens, "memory hit", result)
            tree.append(result.seconds)
        del live_kv
        disk = []
        for tail in tails[repeats : 2 * repeats]:
            fresh = open_cache(engine, disk_dir=disk_dir)
            result = prefill(engine, fresh, prompt + tail)
            _expect(result.num_disk_tokens == num_tokens, "disk hit", result)
            disk.append(result.seconds)
        # Parity: the same sequence through memory and through disk.
        same = prompt + tails[0]
        via_disk = prefill(engine, open_cache(engine, disk_dir=disk_dir), same).logits
        via_memory = prefill(engine, warm, same).logits
        blocks = list(disk_dir.rglob("*.safetensors"))
        stored = sum(p.stat().st_size for p in blocks)
        block_size = warm.block_size
    cold_s, mem_s, disk_s = (statistics.median(x) for x in (cold, mem, disk))
    live_s, tree_s = statistics.median(live), statistics.median(tree)
    measured_per_token = stored / (len(blocks) * block_size) if blocks else None
    return {
        "model": engine.name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "num_tokens": num_tokens,
        "num_new_tokens": num_new,
        "block_size": block_size,
        "repeats": repeats,
        "prefill_cold_s": round(cold_s, 4),
        "prefill_cold_store_s": round(populate_s, 4),
        "prefill_mem_hit_s": round(mem_s, 4),
        "prefill_disk_hit_s": round(disk_s, 4),
        "prefill_tree_hit_s": round(tree_s, 4),
        "live_forward_s": round(live_s, 4),
        "hit_overhead_ms": round((mem_s - live_s) * 1000, 1),
        "tree_hit_overhead_ms": round((tree_s - live_s) * 1000, 1),
        "prefill_mem_hit_s_runs": [round(x, 4) for x in mem],
        "live_forward_s_runs": [round(x, 4) for x in live],
        "speedup_mem_vs_cold": round(cold_s / mem_s, 2),
        "speedup_disk_vs_cold": round(cold_s / disk_s, 2),
        "kv_bytes_per_token": round(measured_per_token, 1) if measured_per_token else None,
        "kv_bytes_per_token_formula": engine.kv_bytes_per_token,
        "stored_over_formula": round(measured_per_token / engine.kv_bytes_per_token, 5)
        if measured_per_token
        else None,
        "num_disk_blocks": len(blocks),
        "cold_computed_tokens": first.num_computed_tokens,
        "mem_equals_disk_logits": bool(torch.equal(via_disk, via_memory)),
        "targets": {
            "speedup_disk_vs_cold": 10,
            "speedup_mem_vs_cold": 10,
            "hit_overhead_ms": 30,
        },
    }


def _live_forward(engine: Any, kv: Any, tail: list[int]) -> float:
    """Seconds of one plain forward of `tail` on `kv` (cropped back afterwards)."""
    import torch

    with torch.inference_mode():
        started = time.perf_counter()
        engine.model(
            input_ids=torch.tensor([tail], device=engine.device),
            cache=kv,
            use_cache=True,
            logits_to_keep=1,
        )
        seconds = time.perf_counter() - started
    kv.crop(-len(tail))
    return seconds


def _expect(ok: bool, what: str, result: Any) -> None:
    if not ok:
        from kvtrace.errors import CacheError

        raise CacheError(
            f"benchmark expected a {what} but got memory={result.num_memory_tokens} "
            f"disk={result.num_disk_tokens} computed={result.num_computed_tokens}"
        )
