"""A prompt's shared part read once for every sequence that starts alike, bits unchanged.

Prompts here pass `SPLIT_BLOCK` tokens, so each decode step splits every
sequence's attention into its shared part and its own; sequences whose
prompts start alike read the shared part in one call. Compared bit for bit
with each sequence decoded alone, at every batch size and row, and against
plain attention over the whole K/V (the split changes only rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtrace.engine import decode_attention
from kvtrace.engine.decode import Decoding, RowRouter
from kvtrace.engine.decode_attention import (
    MAX_SHARING,
    SPLIT_BLOCK,
    SequenceKV,
    SharedPrefix,
    sharing_groups,
)
from kvtrace.engine.decode_attention import (
    decode_attention as attend,
)
from kvtrace.engine.generation import GenerateOptions, Generation, begin
from kvtrace.errors import CacheError
from tests.engine.batch_checks import (
    assert_batch_sizes_match_alone,
    decode_together,
    sampling,
)


def _prompts(tokens) -> list[list[int]]:
    """Four prompts that share more than a split block, then two that start elsewhere."""
    head = tokens(SPLIT_BLOCK + 40, seed=7)
    alike = [head + tokens(5 + 17 * i, seed=i) for i in range(4)]
    return [*alike, tokens(SPLIT_BLOCK + 30, seed=20), tokens(SPLIT_BLOCK // 2, seed=21)]


def _begin(engine, prompt: list[int], i: int) -> Generation:
    begun = begin(engine, None, prompt,
                  GenerateOptions(max_new_tokens=8, stop_ids=(), **sampling(i)))
    assert isinstance(begun, Generation)
    return begun


def test_sequences_that_start_alike_share_and_keep_their_bits(tiny_engine, tokens):
    assert_batch_sizes_match_alone(tiny_engine, _prompts(tokens), num_steps=4)


def test_the_step_groups_the_sequences_whose_prompts_start_alike(tiny_engine, tokens):
    prompts = _prompts(tokens)
    decodings = [_begin(tiny_engine, p, i).decoding for i, p in enumerate(prompts)]
    router = RowRouter(tiny_engine.model.config, decodings)
    assert router.groups == [[0, 1, 2, 3], [4], [5]]
    assert [d.prefix.length if d.prefix else 0 for d in decodings] == [SPLIT_BLOCK] * 5 + [0]


def test_the_split_changes_only_rounding(tokens):
    generator = torch.Generator().manual_seed(3)
    keys = [torch.randn(1, 2, n, 16, generator=generator) for n in (SPLIT_BLOCK + 70,) * 3]
    keys[2][:, :, :SPLIT_BLOCK] = keys[0][:, :, :SPLIT_BLOCK]  # 0 and 2 share their first part
    values = [torch.randn(1, 2, k.shape[2], 16, generator=generator) for k in keys]
    values[2][:, :, :SPLIT_BLOCK] = values[0][:, :, :SPLIT_BLOCK]
    query = torch.randn(1, 4, 4, 16, generator=generator)  # three sequences, one padding row
    sequences = [SequenceKV(k, v, SPLIT_BLOCK) for k, v in zip(keys, values, strict=True)]
    out = attend(query, sequences, [[0, 2], [1]], 0.25)
    for i, (key, value) in enumerate(zip(keys, values, strict=True)):
        plain = F.scaled_dot_product_attention(query[:, :, i : i + 1], key, value, scale=0.25,
                                               enable_gqa=True)
        torch.testing.assert_close(out[:, i : i + 1], plain.transpose(1, 2), rtol=0, atol=1e-5)
    assert torch.equal(out[:, 3], torch.zeros_like(out[:, 3]))


def test_groups_need_the_same_tokens_not_only_the_same_hash():
    a = SharedPrefix.of(list(range(SPLIT_BLOCK + 3)))
    b = SharedPrefix.of([*range(SPLIT_BLOCK - 1), 99999, 5])
    assert a is not None and b is not None
    colliding = SharedPrefix(b.length, b.ids, a.digest)  # a hash collision, made by hand
    assert sharing_groups([a, colliding, a, None]) == [[0, 2], [1], [3]]
    assert SharedPrefix.of(list(range(SPLIT_BLOCK - 1))) is None
    many = sharing_groups([a] * (MAX_SHARING + 2))
    assert [len(g) for g in many] == [MAX_SHARING, 2]


def test_without_exact_sharing_each_sequence_reads_its_own_shared_part(
        tiny_engine, tokens, monkeypatch):
    prompts = _prompts(tokens)[:3]
    shared = decode_together(tiny_engine, prompts, [0, 1, 2], 3)
    calls: list[int] = []
    real_flash = decode_attention._flash

    def counted_flash(rows, *args):
        calls.append(rows.shape[1])  # query rows of the call
        return real_flash(rows, *args)

    monkeypatch.setattr(decode_attention, "sharing_is_exact", lambda *shape: False)
    monkeypatch.setattr(decode_attention, "_flash", counted_flash)
    unshared = decode_together(tiny_engine, prompts, [0, 1, 2], 3)
    per_head = tiny_engine.model.config.num_attention_heads // (
        tiny_engine.model.config.num_key_value_heads)
    assert set(calls) == {per_head}  # no call read more than one sequence's rows
    for a, b in zip(shared, unshared, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_prompt_ids_must_match_the_kv(tiny_engine, tokens):
    prompt = tokens(20)
    begun = _begin(tiny_engine, prompt, 0)
    with pytest.raises(CacheError, match="prompt ids"):
        Decoding(begun.decoding.kv, begun.decoding.logits, temperature=0.0, top_p=1.0,
                 generator=None, prompt_ids=prompt[:-1])
