"""Cache benchmark for models with window or state layers (engine/statecache.py).

The cases of cache.py on the block-state path, side by side in one process:
cold (every token computed in block chunks), memory hit and disk hit (the
prompt's blocks cached, `num_new` new tokens computed), and the parity of
memory and disk. Then memory per 1,000 tokens for each layer kind, measured
against the formula (layers.py):

- `live`: what one sequence's cache holds after the prompt (full layers
  grow with it, window layers stop at the window, state layers constant),
  measured on the tensors prefill left, against `ModelLayout.num_bytes`;
- `stored`: what the cache's tiers keep per 1,000 tokens (each block's own
  K/V rows for attention layers, at most `window - 1` for window layers,
  and one state snapshot per block for state layers).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvtrace.engine.modelstate import ModelState, is_state_name, kv_layer


def run_state_cache_bench(engine: Any, *, num_tokens: int, num_new: int, repeats: int,
                          seed: int) -> dict[str, Any]:
    import torch

    from kvtrace.engine import StateCache, prefill

    generator = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    prompt = torch.randint(100, vocab, (num_tokens,), generator=generator).tolist()
    tails = [torch.randint(100, vocab, (num_new,), generator=generator).tolist()
             for _ in range(2 * repeats)]
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-cache-") as tmp:
        disk_dir = Path(tmp) / "kv"
        colds = [prefill(engine, None, prompt) for _ in range(repeats)]
        live = _live_bytes(engine, colds[-1].kv)
        cold = [result.seconds for result in colds]
        del colds
        warm = StateCache(engine, disk_dir=disk_dir)
        prefill(engine, warm, prompt)
        resume = num_tokens - num_tokens % warm.block_size
        mem, disk = [], []
        for tail in tails[:repeats]:
            result = prefill(engine, warm, prompt + tail)
            _expect(result.num_memory_tokens == resume, "memory hit", result.num_memory_tokens)
            mem.append(result.seconds)
        for tail in tails[repeats:]:
            result = prefill(engine, StateCache(engine, disk_dir=disk_dir), prompt + tail)
            _expect(result.num_disk_tokens == resume, "disk hit", result.num_disk_tokens)
            disk.append(result.seconds)
        same = prompt + tails[0]
        via_disk = prefill(engine, StateCache(engine, disk_dir=disk_dir), same).logits
        via_memory = prefill(engine, warm, same).logits
        cold_of_same = prefill(engine, None, same).logits
        stored = _stored_bytes(engine, warm)
        block_size = warm.block_size
    cold_s, mem_s, disk_s = (statistics.median(x) for x in (cold, mem, disk))
    per_1k = 1000 / num_tokens
    formula = engine.layout.num_bytes(num_tokens)
    kinds = {
        str(kind): {
            "layers": len(indices),
            "live_bytes_per_1k_tokens": round(live.get(str(kind), 0) * per_1k),
            "formula_bytes_per_1k_tokens": round(formula[kind] * per_1k),
            "stored_bytes_per_1k_tokens": round(stored.get(str(kind), 0) * 1000
                                                / max(1, resume)),
        }
        for kind, indices in engine.layout.kinds().items()
    }
    return {
        "model": engine.name,
        "layout": engine.layout.describe(),
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "num_tokens": num_tokens,
        "num_new_tokens": num_new,
        "block_size": block_size,
        "resume_tokens": resume,
        "repeats": repeats,
        "prefill_cold_s": round(cold_s, 4),
        "prefill_mem_hit_s": round(mem_s, 4),
        "prefill_disk_hit_s": round(disk_s, 4),
        "speedup_mem_vs_cold": round(cold_s / mem_s, 2),
        "speedup_disk_vs_cold": round(cold_s / disk_s, 2),
        "mem_equals_disk_logits": bool(torch.equal(via_disk, via_memory)),
        "hit_equals_cold_logits": bool(torch.equal(via_memory, cold_of_same)),
        "memory_per_kind": kinds,
        "targets": {"speedup_disk_vs_cold": 10, "speedup_mem_vs_cold": 10},
    }


def _live_bytes(engine: Any, state: Any) -> dict[str, int]:
    """Bytes of one sequence's cache after prefill, per layer kind (the tensors themselves)."""
    sizes: dict[str, int] = {}
    if state.cache is None:  # a state list: every layer a state layer
        tensors = state.state_tensors_per_layer()
        layers = [sum(t.numel() * t.element_size() for t in ts) for ts in tensors]
    else:
        layers = []
        for layer in state.cache.layers:
            keys = getattr(layer, "keys", None)
            kv = 2 * keys.numel() * keys.element_size() if keys is not None else 0
            layers.append(kv + sum(t.numel() * t.element_size()
                                   for t in ModelState.layer_states(layer)))
    for spec, num_bytes in zip(engine.layout.layers, layers, strict=True):
        sizes[str(spec.kind)] = sizes.get(str(spec.kind), 0) + num_bytes
    return sizes


def _stored_bytes(engine: Any, cache: Any) -> dict[str, int]:
    """Bytes of the tiers' blocks, per layer kind (from the blocks' tensor names)."""
    sizes: dict[str, int] = {}
    for state in cache.block_states():
        for name, tensor in state.tensors.items():
            # A state list's tensor covers every layer (all state layers): layer 0's kind.
            index = kv_layer(name) if not is_state_name(name) else state_layer(name)
            kind = str(engine.layout.layers[index].kind)
            sizes[kind] = sizes.get(kind, 0) + tensor.numel() * tensor.element_size()
    return sizes


def state_layer(name: str) -> int:
    """The layer of a state tensor: `c3.0`, `r3.0` -> 3; a state list's `s0` -> 0."""
    return 0 if name.startswith("s") else int(name[1:].split(".")[0])


def _expect(ok: bool, case: str, got: int) -> None:
    if not ok:
        raise RuntimeError(f"bench cache: the {case} reused {got} tokens, not the prompt's blocks")
