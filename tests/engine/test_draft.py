"""Checking an expected response (a draft) in one prefill instead of decoding it."""

from __future__ import annotations

import pytest
import torch

from kvtrace.engine import KVCache, generate, prefill
from kvtrace.engine.generation import draft_margin
from kvtrace.errors import UsageError


def _greedy(engine, prompt, n):
    return generate(engine, None, prompt, max_new_tokens=n, stop_ids=[])


def test_logits_from_mid_chunk_gives_the_same_rows_cached_and_cold(tiny_engine, tokens):
    sequence = tokens(150, seed=21)
    cache = KVCache(tiny_engine)
    prefill(tiny_engine, cache, sequence[:64] + tokens(10, seed=22))  # 64 tokens shared

    hot = prefill(tiny_engine, cache, sequence, logits_from=100)
    cold = prefill(tiny_engine, None, sequence, logits_from=100)

    assert hot.num_memory_tokens == 64
    assert hot.logits.shape == cold.logits.shape == (50, tiny_engine.vocab_size)
    assert torch.equal(hot.logits, cold.logits)
    # Row i predicts the token after position 100 + i, as a plain prefill up to there does.
    for row in (0, 27, 49):
        plain = prefill(tiny_engine, None, sequence[: 101 + row])
        assert torch.argmax(hot.logits[row]) == torch.argmax(plain.logits)


def test_reuse_stops_at_logits_from(tiny_engine, tokens):
    sequence = tokens(150, seed=23)
    cache = KVCache(tiny_engine)
    prefill(tiny_engine, cache, sequence)
    rows = prefill(tiny_engine, cache, sequence, logits_from=120, reduce_logits=lambda r: r[:, :2])
    assert rows.num_memory_tokens == 120 and rows.num_computed_tokens == 30
    assert rows.logits.shape == (30, 2)


def test_logits_from_outside_the_sequence_is_a_usage_error(tiny_engine, tokens):
    with pytest.raises(UsageError, match="logits_from"):
        prefill(tiny_engine, None, tokens(10, seed=1), logits_from=10)


def test_decoding_and_the_draft_check_differ_far_below_the_margin(tiny_engine, tokens):
    """The margin's premise: 1-row decode logits and canonical rows differ in the last bits."""
    prompt = tokens(140, seed=24)
    pre = prefill(tiny_engine, None, prompt)
    decoded, out = [pre.logits], []
    with torch.inference_mode():
        for _ in range(30):
            out.append(int(torch.argmax(decoded[-1])))
            step = tiny_engine.model(input_ids=torch.tensor([[out[-1]]]), cache=pre.kv,
                                     use_cache=True, logits_to_keep=1)
            decoded.append(step.logits[0, -1].float())
    rows = prefill(tiny_engine, None, prompt + out, logits_from=len(prompt) - 1).logits
    assert (rows - torch.stack(decoded)).abs().max() < draft_margin(tiny_engine.dtype) / 10


def test_the_greedy_output_as_draft_is_accepted_without_decoding(tiny_engine, tokens, kv_equal):
    prompt = tokens(130, seed=25)
    plain = _greedy(tiny_engine, prompt, 12)
    cache = KVCache(tiny_engine)

    drafted = generate(tiny_engine, cache, prompt, max_new_tokens=12, stop_ids=[],
                       draft_ids=plain.token_ids)

    assert drafted.draft == "accepted"
    assert drafted.token_ids == plain.token_ids and drafted.finish_reason == "length"
    assert drafted.insert_seconds == 0.0
    assert drafted.prefill.num_computed_tokens == len(prompt) + 12
    # The cache holds prompt + output canonically, as after plain generation.
    following = [*prompt, *plain.token_ids, *tokens(5, seed=26)]
    hot = prefill(tiny_engine, cache, following)
    assert hot.num_memory_tokens == len(prompt) + 12
    assert kv_equal(hot, prefill(tiny_engine, None, following))


def test_a_draft_ending_on_a_stop_token_finishes_with_stop(tiny_engine, tokens):
    prompt = tokens(80, seed=27)
    first = _greedy(tiny_engine, prompt, 1).token_ids[0]  # made a stop token below

    drafted = generate(tiny_engine, None, prompt, max_new_tokens=8, stop_ids=[first],
                       draft_ids=[first])

    assert drafted.draft == "accepted"
    assert drafted.token_ids == (first,) and drafted.finish_reason == "stop"


@pytest.mark.parametrize("cached", [True, False])
def test_a_wrong_draft_is_rejected_and_generation_decodes_as_usual(tiny_engine, tokens, cached):
    prompt = tokens(90, seed=28)
    plain = _greedy(tiny_engine, prompt, 10)
    wrong = list(plain.token_ids)
    wrong[4] = (wrong[4] + 1) % tiny_engine.vocab_size

    drafted = generate(tiny_engine, KVCache(tiny_engine) if cached else None, prompt,
                       max_new_tokens=10, stop_ids=[], draft_ids=wrong)

    assert drafted.draft == "rejected"
    assert drafted.token_ids == plain.token_ids
    # Accounting is the first prefill's: nothing was cached before it.
    assert drafted.prefill.num_computed_tokens == len(prompt) + 10
    assert drafted.prefill.kv is None
    assert drafted.prefill_seconds > drafted.prefill.seconds


@pytest.mark.parametrize(
    "case",
    ["shorter than max_new_tokens", "longer than max_new_tokens", "stop token inside",
     "sampled", "output not cached", "not this vocabulary"],
)
def test_a_draft_that_cannot_be_the_generation_is_not_checked(tiny_engine, tokens, case):
    prompt = tokens(70, seed=29)
    plain = _greedy(tiny_engine, prompt, 10)
    ids = list(plain.token_ids)
    options: dict = {"max_new_tokens": 10, "stop_ids": [], "draft_ids": ids}
    if case == "shorter than max_new_tokens":
        options["draft_ids"] = ids[:6]
    elif case == "longer than max_new_tokens":
        options["max_new_tokens"] = 8
    elif case == "stop token inside":
        options["stop_ids"] = [ids[3]]
    elif case == "sampled":
        options.update(temperature=0.8, seed=3)
    elif case == "output not cached":
        options["insert_output"] = False
    else:
        options["draft_ids"] = [*ids[:-1], tiny_engine.vocab_size + 5]

    result = generate(tiny_engine, KVCache(tiny_engine), prompt, **options)

    assert result.draft is None
    expected = dict(options, draft_ids=None)
    assert result.token_ids == generate(tiny_engine, None, prompt, **expected).token_ids


def test_half_precision_drafts_are_left_to_decoding(tiny_folder, engine_root, tokens):
    """The margin was measured in fp32 only: a bf16 engine decodes."""
    from kvtrace.engine import load_engine

    engine = load_engine(tiny_folder, cache_dir=engine_root / "cache", dtype="bfloat16")
    prompt = tokens(40, seed=30)
    plain = _greedy(engine, prompt, 6)

    drafted = generate(engine, None, prompt, max_new_tokens=6, stop_ids=[],
                       draft_ids=plain.token_ids)

    assert draft_margin(engine.dtype) is None
    assert drafted.draft is None and drafted.token_ids == plain.token_ids
