"""Decode throughput of 8 generations decoded together vs one after another.

Why: issue 20's forks run K agents from one point at once; the engine
serves their concurrent calls by decoding them together (kvtrace/engine/
batch.py). The target is >= 3x the total decode throughput (completion
tokens per second) of the same generations run one after another, on the
default model, on a 2-core machine, with prompts of ~1-2k tokens sharing a
prefix. Also printed: a lone generation's time per token with today's padded
16-row decode step against the 1-row forward it replaced (emulated here as
generation.py ran it), alternating, at the same context.

Each trial starts from a cache holding only the shared prefix (so both sides
prefill the same tails). Sequential: `generate` 8 times; decode time is the
sum of their `decode_seconds`. Together: 8 threads through one
`DecodeBatcher`; its engine thread runs everything in turn, so decode time
is the wall time less every prefill and output insert. Every generation
decodes exactly NEW tokens (no stop ids), and both sides' tokens are checked
equal.

Usage: .venv/bin/python scripts/batch_decode.py [TRIALS] [NEW]   (default 2, 64)
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from kvtrace.bench.decode import decode_together
from kvtrace.engine import GenerateOptions, KVCache, generate, load_engine, prefill
from kvtrace.engine.batch import DecodeBatcher
from kvtrace.paths import default_cache_dir

NUM_GENERATIONS = 8
SHARED = 1_000


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(20)
    head = [rng.randrange(100, vocab) for _ in range(SHARED)]
    return [head + [rng.randrange(100, vocab) for _ in range(100 + 100 * i)]
            for i in range(NUM_GENERATIONS)]


def sequential(engine, cache, prompts, new):
    started = time.perf_counter()
    # The batcher's padded step, one generation at a time: the same tokens as together.
    results = [generate(engine, cache, p, max_new_tokens=new, stop_ids=(), padded_decode=True)
               for p in prompts]
    wall = time.perf_counter() - started
    return results, sum(r.decode_seconds for r in results), wall


def together(engine, cache, prompts, new):
    batcher = DecodeBatcher(engine, cache)
    options = GenerateOptions(max_new_tokens=new, stop_ids=())
    try:
        results, wall = decode_together(batcher, prompts, options)
    finally:
        batcher.close()
    assert batcher.max_step_rows == len(prompts)
    busy = sum(r.prefill_seconds + r.insert_seconds for r in results)
    return results, wall - busy, wall


def one_row_decode(engine, cache, prompt, new):
    """The decode loop as generation.py ran it before batching: 1-row forwards."""
    pre = prefill(engine, cache, prompt)
    logits = pre.logits
    started = time.perf_counter()
    with torch.inference_mode():
        for _ in range(new - 1):
            token = int(torch.argmax(logits).item())
            out = engine.model(input_ids=torch.tensor([[token]]), cache=pre.kv,
                               use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1].float()
    return (time.perf_counter() - started) / (new - 1)


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    engine = load_engine(None, cache_dir=default_cache_dir())
    batch = prompts(engine.vocab_size)
    lengths = [len(p) for p in batch]
    print(f"{NUM_GENERATIONS} prompts of {min(lengths)}-{max(lengths)} tokens "
          f"({SHARED} shared), {new} new tokens each, torch threads {torch.get_num_threads()}")
    ratios = []
    for trial in range(trials):
        runs = {}
        for name, fn in (("sequential", sequential), ("together", together)):
            cache = KVCache(engine)
            prefill(engine, cache, batch[0][:SHARED])
            results, decode_s, wall = fn(engine, cache, batch, new)
            runs[name] = [r.token_ids for r in results]
            tokens = sum(len(r.token_ids) for r in results)
            print(f"trial {trial + 1} {name:10s}: decode {decode_s:6.2f} s "
                  f"({tokens / decode_s:6.1f} tok/s), wall {wall:6.2f} s "
                  f"({tokens / wall:6.1f} tok/s)")
            runs[name + "_tps"] = tokens / decode_s
        assert runs["sequential"] == runs["together"], "batched tokens differ from sequential"
        ratios.append(runs["together_tps"] / runs["sequential_tps"])
        print(f"trial {trial + 1} decode throughput together / sequential: {ratios[-1]:.2f}x")
    print(f"median ratio {statistics.median(ratios):.2f}x over {trials} trials")
    lone_new, lone_prompt = 32, batch[-1]
    padded, one_row = [], []
    for _ in range(trials):
        cache = KVCache(engine)
        result = generate(engine, cache, lone_prompt, max_new_tokens=lone_new, stop_ids=(),
                          padded_decode=True)
        padded.append(result.decode_seconds / (lone_new - 1))
        one_row.append(one_row_decode(engine, KVCache(engine), lone_prompt, lone_new))
    print(f"lone request at {len(lone_prompt)} tokens: padded 16-row step "
          f"{1000 * min(padded):.1f} ms/token, 1-row step {1000 * min(one_row):.1f} ms/token "
          f"(best of {trials})")


if __name__ == "__main__":
    main()
