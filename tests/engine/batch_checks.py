"""Decoding sequences together and alone, compared bit for bit (test_batch.py and
test_decode_attention.py)."""

from __future__ import annotations

import torch

from kvtrace.engine import KVCache
from kvtrace.engine.decode import decode_step
from kvtrace.engine.generation import GenerateOptions, Generation, begin


def sampling(i: int) -> dict:
    """Every other sequence samples, each from a seed of its own."""
    return {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i} if i % 2 else {}


def decode_together(engine, prompts: list[list[int]], chosen: list[int], num_steps: int,
                    cache: KVCache | None = None) -> list[list[torch.Tensor]]:
    """Logits after every step, per sequence, decoding prompts[chosen] together (no stop ids).

    With a `cache`, prompts reuse what earlier ones computed (the same bits,
    tests/engine/test_parity.py) and each takes its KV out of the cache's
    buffers, as the batcher does, so the next prefill cannot write over it.
    """
    generations = []
    for i in chosen:
        begun = begin(engine, cache, prompts[i], GenerateOptions(
            max_new_tokens=num_steps + 1, stop_ids=(), **sampling(i)))
        assert isinstance(begun, Generation)
        begun.decoding.detach()
        generations.append(begun)
    seen: list[list[torch.Tensor]] = [[g.decoding.logits.clone()] for g in generations]
    for _ in range(num_steps):
        for generation in generations:
            assert not generation.advance()
        decode_step(engine, [g.decoding for g in generations])
        for logits, generation in zip(seen, generations, strict=True):
            logits.append(generation.decoding.logits.clone())
    return seen


def assert_batch_sizes_match_alone(engine, prompts: list[list[int]], num_steps: int,
                                    cache: KVCache | None = None) -> None:
    alone = [decode_together(engine, prompts, [i], num_steps, cache)[0]
             for i in range(len(prompts))]
    for size in range(1, len(prompts) + 1):
        # Sequences take other rows in every batch: the last `size` prompts, reversed.
        chosen = list(range(len(prompts) - size, len(prompts)))[::-1]
        together = decode_together(engine, prompts, chosen, num_steps, cache)
        for row, i in enumerate(chosen):
            for step, (a, b) in enumerate(zip(alone[i], together[row], strict=True)):
                assert torch.equal(a, b), f"batch of {size}: sequence {i} (row {row}) step {step}"
