"""Batched decoding gives every generation the tokens and logits it gets alone.

Two levels: `decode_step` over 1 to 8 sequences (logits compared bit for bit
at every step with the same sequence decoded alone, at whatever row it sits),
and `DecodeBatcher`, whose threads' generations (greedy and seeded sampling,
stop tokens, length limits, a cancellation) and cache contents must equal
those of `generate` run one after another.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtrace.engine import GenerateOptions, KVCache, generate, prefill
from kvtrace.engine.batch import DecodeBatcher
from kvtrace.engine.decode import decode_forward, decode_rows, row_multiple
from kvtrace.engine.decode_attention import SPLIT_BLOCK
from kvtrace.engine.generation import Generation, begin
from kvtrace.errors import GenerationCancelledError, UsageError
from tests.engine.batch_checks import assert_batch_sizes_match_alone, sampling
from tests.held_engine import engine_held

SHARED = 150  # tokens every prompt starts with (a shared prefix, as forks have)


def _prompts(tokens, count: int, shared: int = SHARED) -> list[list[int]]:
    """Prompts that share a prefix and differ in length after it."""
    head = tokens(shared, seed=99)
    return [head + tokens(7 + 23 * i, seed=i) for i in range(count)]


def test_decode_rows_are_a_multiple_of_the_engines_multiple():
    assert [decode_rows(n) for n in (1, 8, 16, 17, 33)] == [16, 16, 16, 32, 48]
    assert [decode_rows(n, 4) for n in (1, 4, 5, 8, 9, 16)] == [4, 4, 8, 8, 12, 16]


def test_the_probed_multiple_is_one_whose_forwards_give_a_16_row_forwards_bits(
        tiny_engine, tokens):
    multiple = row_multiple(tiny_engine)
    assert multiple in (4, 8, 16) and row_multiple(tiny_engine) == multiple  # probed once
    prompt = tokens(90, seed=5)
    seen = {}
    for width in sorted({multiple, 16}):
        begun = begin(tiny_engine, None, prompt, GenerateOptions(max_new_tokens=4, stop_ids=()))
        assert isinstance(begun, Generation)
        begun.advance()
        decode_forward(tiny_engine, [begun.decoding], width)
        seen[width] = begun.decoding.logits
    assert torch.equal(seen[multiple], seen[16])


def test_batched_logits_equal_alone_at_batch_sizes_1_to_12(tiny_engine, tokens):
    # With a multiple of 4 this spans forwards of 4, 8 and 12 rows against the alone 4.
    assert_batch_sizes_match_alone(tiny_engine, _prompts(tokens, 12), num_steps=6)


def test_bfloat16_batched_logits_equal_alone_at_batch_sizes_1_to_8(bf16_engine, tokens):
    assert_batch_sizes_match_alone(bf16_engine, _prompts(tokens, 8), num_steps=4)


@pytest.mark.slow
def test_default_model_in_bfloat16_batched_logits_equal_alone(tokens):
    from kvtrace.engine import load_engine
    from kvtrace.paths import default_cache_dir

    engine = load_engine(None, cache_dir=default_cache_dir(), dtype="bfloat16")
    prompts = _prompts(tokens, 8, shared=SPLIT_BLOCK + 60)
    assert_batch_sizes_match_alone(engine, prompts, num_steps=4, cache=KVCache(engine))


@pytest.mark.slow
def test_default_model_batched_logits_equal_alone_at_batch_sizes_1_to_8(default_engine, tokens):
    # Past a split block, so the prompts' shared part is read once (decode_attention.py);
    # through a cache, so that 44 prefills of ~1,100 tokens compute each prompt once.
    prompts = _prompts(tokens, 8, shared=SPLIT_BLOCK + 60)
    assert_batch_sizes_match_alone(default_engine, prompts, num_steps=4,
                                    cache=KVCache(default_engine))


def _requests(tiny_engine, tokens, count: int) -> list[tuple[list[int], dict]]:
    """Mixed requests: greedy and sampled, different limits, one stopping on a token."""
    requests = []
    for i, prompt in enumerate(_prompts(tokens, count)):
        options = {"max_new_tokens": 6 + 3 * i, **sampling(i)}
        requests.append((prompt, options))
    # The second request (sampled) stops early: on its first token not drawn before.
    prompt, options = requests[1]
    drawn = generate(tiny_engine, None, prompt, padded_decode=True,
                     **{**options, "stop_ids": ()}).token_ids
    stop = next(t for k, t in enumerate(drawn) if k >= 2 and t not in drawn[:k])
    requests[1] = (prompt, {**options, "stop_ids": [stop]})
    return requests


def _run_together(batcher: DecodeBatcher, requests, **extra) -> list:
    """Every request on a thread of its own, all admitted at once (held behind one call)."""
    results: list = [None] * len(requests)

    def run(i: int) -> None:
        prompt, options = requests[i]
        try:
            results[i] = batcher.generate(prompt, GenerateOptions(**options, **extra))
        except Exception as exc:  # the test asserts on it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    with engine_held(batcher, until_waiting=len(requests)):
        for thread in threads:
            thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


@pytest.mark.parametrize("defer_output", [False, True])
def test_batcher_generations_and_cache_equal_one_after_another(
    tiny_engine, tokens, make_cache, kv_equal, defer_output
):
    requests = _requests(tiny_engine, tokens, 8)
    alone_cache = make_cache(tiny_engine, disk_dir=None)
    alone = [generate(tiny_engine, alone_cache, p, defer_output=defer_output,
                      padded_decode=True, **o)
             for p, o in requests]
    cache = make_cache(tiny_engine, disk_dir=None)
    with DecodeBatcher(tiny_engine, cache) as batcher:
        together = _run_together(batcher, requests, defer_output=defer_output)
    assert batcher.max_step_rows == 8
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.finish_reason for r in together] == [r.finish_reason for r in alone]
    assert together[1].finish_reason == "stop" and len(together[1].token_ids) >= 3
    assert [r.seed for r in together] == [r.seed for r in alone]
    assert sorted(cache.owed()) == sorted(alone_cache.owed())
    for (prompt, _), result in zip(requests, together, strict=True):
        sequence = [*prompt, *result.token_ids, 5]
        cached = prefill(tiny_engine, cache, sequence)
        assert cached.num_cached_tokens + cached.num_deferred_tokens == len(sequence) - 1
        assert kv_equal(cached, prefill(tiny_engine, None, sequence))


def test_a_cancelled_generation_leaves_the_others_unchanged(tiny_engine, tokens, make_cache):
    requests = _requests(tiny_engine, tokens, 4)
    alone = [generate(tiny_engine, None, p, padded_decode=True, **o) for p, o in requests]
    asked = {"count": 0}

    def after_two_tokens() -> bool:
        asked["count"] += 1
        return asked["count"] > 2

    prompt, options = requests[3]
    requests[3] = (prompt, {**options, "is_cancelled": after_two_tokens})
    cache = make_cache(tiny_engine, disk_dir=None)
    with DecodeBatcher(tiny_engine, cache) as batcher:
        together = _run_together(batcher, requests)
    assert isinstance(together[3], GenerationCancelledError)
    assert [r.token_ids for r in together[:3]] == [r.token_ids for r in alone[:3]]
    assert sorted(cache.owed()) == []
    # the cancelled prompt stays cached, its partial output does not
    reuse = prefill(tiny_engine, cache, [*prompt, *alone[3].token_ids])
    assert reuse.num_cached_tokens == len(prompt)


def test_a_generation_cancelled_while_it_waits_is_never_prefilled(tiny_engine, tokens,
                                                                   make_cache):
    requests = _requests(tiny_engine, tokens, 3)
    alone = [generate(tiny_engine, None, p, padded_decode=True, **o) for p, o in requests]
    prompt, options = requests[2]
    requests[2] = (prompt, {**options, "is_cancelled": lambda: True})  # its caller left
    cache = make_cache(tiny_engine, disk_dir=None)
    with DecodeBatcher(tiny_engine, cache) as batcher:
        together = _run_together(batcher, requests)
    assert isinstance(together[2], GenerationCancelledError)
    assert "before it started" in str(together[2])
    assert [r.token_ids for r in together[:2]] == [r.token_ids for r in alone[:2]]
    # never prefilled: of its prompt, only the prefix it shares with the others is cached
    assert prefill(tiny_engine, cache, prompt).num_cached_tokens < len(prompt) - 1


def test_batches_past_max_batch_wait_their_turn(tiny_engine, tokens):
    requests = _requests(tiny_engine, tokens, 5)
    alone = [generate(tiny_engine, None, p, padded_decode=True, **o) for p, o in requests]
    with DecodeBatcher(tiny_engine, None, max_batch=2) as batcher:
        together = _run_together(batcher, requests)
    assert batcher.max_step_rows == 2
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_bad_request_fails_alone(tiny_engine, tokens):
    requests = _requests(tiny_engine, tokens, 3)
    alone = [generate(tiny_engine, None, p, padded_decode=True, **o) for p, o in requests]
    requests[1] = (requests[1][0], {**requests[1][1], "top_p": 0.0})
    with DecodeBatcher(tiny_engine, KVCache(tiny_engine)) as batcher:
        together = _run_together(batcher, requests)
    assert isinstance(together[1], UsageError)
    assert [together[0].token_ids, together[2].token_ids] == [
        alone[0].token_ids, alone[2].token_ids]


def test_closed_batcher_refuses_jobs(tiny_engine):
    batcher = DecodeBatcher(tiny_engine, None)
    batcher.close()
    with pytest.raises(UsageError, match="closed"):
        batcher.generate([5, 6, 7], GenerateOptions(max_new_tokens=2))
    with pytest.raises(UsageError, match="max_batch"):
        DecodeBatcher(tiny_engine, None, max_batch=0)


def test_local_backend_batching_answers_threads_as_alone(tiny_engine, tokens):
    from kvtrace.engine.sampling import SamplingParams
    from kvtrace.replay.backend import CallRequest
    from kvtrace.replay.local import LocalBackend

    prompts = _prompts(tokens, 4)
    calls = [CallRequest([], p, SamplingParams(max_new_tokens=5, **sampling(i)))
             for i, p in enumerate(prompts)]
    alone_backend = LocalBackend(tiny_engine, KVCache(tiny_engine)).batching()
    alone = [alone_backend.generate(c) for c in calls]  # one at a time, through a batcher
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine)).batching()
    rebuild = CallRequest([], prompts[0], SamplingParams(), output_ids=[7, 8, 9])
    results: list = [None] * (len(calls) + 1)

    def run(i: int) -> None:
        results[i] = backend.generate(calls[i]) if i < len(calls) else backend.rebuild(rebuild)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(results))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    backend.settle()
    assert [r.output_ids for r in results[:-1]] == [r.output_ids for r in alone]
    assert [r.seed for r in results[:-1]] == [r.seed for r in alone]
    assert results[-1].output_ids == [7, 8, 9]


def test_a_loading_batcher_decodes_on_the_thread_that_loaded(tiny_engine, tokens):
    loaders: list[threading.Thread] = []

    def load():
        loaders.append(threading.current_thread())
        return tiny_engine, KVCache(tiny_engine)

    requests = _requests(tiny_engine, tokens, 3)
    alone = [generate(tiny_engine, None, p, padded_decode=True, **o) for p, o in requests]
    batcher = DecodeBatcher.loading(load, max_batch=2)
    assert loaders and loaders[0] is not threading.current_thread()
    assert batcher.call(threading.current_thread) is loaders[0]
    together = _run_together(batcher, requests)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    batcher.close()
    assert not loaders[0].is_alive()


def test_a_failed_load_raises_in_the_caller_and_leaves_no_thread():
    def load():
        raise ValueError("no such model")

    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="no such model"):
        DecodeBatcher.loading(load)
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:  # the loading thread, if it has not returned yet
        thread.join(timeout=10)
    assert not [t for t in started if t.is_alive()]


def test_open_local_backend_batching_loads_on_its_engine_thread(tiny_folder, engine_root, tokens):
    from kvtrace.engine.sampling import SamplingParams
    from kvtrace.replay.backend import CallRequest
    from kvtrace.replay.local import open_local_backend

    backend = open_local_backend(tiny_folder, cache_dir=engine_root / "cache",
                                 kv_dir=engine_root / "kv-batching", batching=True)
    batcher = backend.batcher
    assert batcher is not None and backend.is_concurrent
    engine_thread = batcher.call(threading.current_thread)
    assert engine_thread is not threading.current_thread()
    prompt = tokens(40, seed=3)
    call = CallRequest([], prompt, SamplingParams(max_new_tokens=6, **sampling(1)))
    alone = generate(backend.engine, None, prompt, max_new_tokens=6, padded_decode=True,
                     **sampling(1))
    assert list(backend.generate(call).output_ids) == list(alone.token_ids)
    backend.close()
    assert not engine_thread.is_alive()


def test_an_engine_thread_kept_trimmed_trims_once_idle_after_work_and_still_closes(
        tiny_engine):
    from kvtrace.engine.heap import HeapTrimmer

    with DecodeBatcher(tiny_engine, None) as batcher:
        trimmer = batcher.keep_heap_trimmed(HeapTrimmer(idle_s=0.05, busy_s=1e9))
        assert batcher.keep_heap_trimmed() is trimmer  # one trimmer per engine thread
        time.sleep(0.3)
        assert trimmer.num_trims == 0  # idle with nothing done: nothing to trim
        assert batcher.call(lambda: 7) == 7
        deadline = time.monotonic() + 10
        while trimmer.num_trims == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert trimmer.num_trims == 1
        time.sleep(0.3)
        assert trimmer.num_trims == 1  # once per idle spell, not every idle_s
        started = time.monotonic()
    assert time.monotonic() - started < 5  # close() did not wait on the trimmer
