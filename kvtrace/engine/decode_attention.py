"""A decode step's attention: each sequence's query over its own K/V, a shared prompt read once.

Why: with eight sequences forked from one point of a long run, most of a
batched decode step went to attention (66 % of an 8-sequence step at a
3,500-token fork point), each sequence reading the same fork-point KV on its
own. Here the first part of a sequence's prompt, `SPLIT_BLOCK` tokens at a
time, is attended as one operation for every sequence in the step whose
prompt starts with the same tokens (whose KV is then the same bits, being a
canonical prefill's, cache.py); the rest of its K/V (the prompt's tail and
what it decoded) on its own; the two halves merged by their log-sum-exps.

Why a row's bits do not depend on what else is decoded (the rule every
decode step keeps, decode.py):

- **where a sequence splits is its own**: at its prompt's length rounded
  down to a multiple of `SPLIT_BLOCK` (no split under it), whatever shares
  the step. Alone it computes the same two halves and the same merge;
- **rows, not heads**: the query heads that read one KV head are that head's
  rows (grouped-query attention folded into rows), padded to a multiple of
  `ROW_PAD`. torch's CPU flash-attention kernel gives a row the same bits
  in any such row count up to 48 and at any position (it does not for 1-3
  rows, which is why alone pads to 4): `sharing_is_exact` probes it once
  per shape in this process and, where it does not hold, every sequence
  attends to its shared part on its own (the same halves, unshared);
- **the merge has fixed shapes**: each sequence's halves are copied out and
  merged alone, so no vector loop sees other sequences' values.

Only on CPU, where that kernel (`_scaled_dot_product_flash_attention_for_cpu`,
which returns the log-sum-exp `scaled_dot_product_attention` does not) is
found; elsewhere each row goes through `scaled_dot_product_attention` over
its whole K/V, as before. Decoded KV is never stored (generation.py), so the
split changes no stored bit.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SPLIT_BLOCK = 1024  # a prompt's shared part is a multiple of this many tokens
ROW_PAD = 4  # query rows per flash-attention call: a multiple of this
MAX_SHARING = 16  # sequences in one shared call (48 rows for three query heads per KV head)
_PROBE_KEYS = 2 * SPLIT_BLOCK


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """The part of a sequence's prompt that others with the same tokens may read with it."""

    length: int
    ids: tuple[int, ...]
    digest: int  # hash(ids), once: the step groups by it

    @classmethod
    def of(cls, prompt_ids: Sequence[int]) -> SharedPrefix | None:
        length = len(prompt_ids) // SPLIT_BLOCK * SPLIT_BLOCK
        if length == 0:
            return None
        ids = tuple(int(t) for t in prompt_ids[:length])
        return cls(length, ids, hash(ids))


@dataclass(frozen=True, slots=True)
class SequenceKV:
    """One sequence's whole K/V `[1, kv_heads, length, dim]` and where its shared part ends."""

    key: torch.Tensor
    value: torch.Tensor
    split: int


def sharing_groups(prefixes: Sequence[SharedPrefix | None]) -> list[list[int]]:
    """Indices of the sequences that attend to their shared part together, in order.

    Sequences with the same prefix (length and tokens) share, at most
    `MAX_SHARING` to a call; every other sequence is a group of its own.
    """
    groups: list[list[int]] = []
    open_groups: dict[tuple[int, int], list[list[int]]] = {}
    for i, prefix in enumerate(prefixes):
        if prefix is None:
            groups.append([i])
            continue
        candidates = open_groups.setdefault((prefix.length, prefix.digest), [])
        for group in candidates:
            head = prefixes[group[0]]
            if len(group) < MAX_SHARING and head is not None and head.ids == prefix.ids:
                group.append(i)
                break
        else:
            group = [i]
            candidates.append(group)
            groups.append(group)
    return groups


def decode_attention(query: torch.Tensor, sequences: Sequence[SequenceKV],
                     groups: Sequence[Sequence[int]], scale: float) -> torch.Tensor:
    """Row i of `query` `[1, heads, width, dim]` over sequence i's K/V; zeros past them.

    Returns `[1, width, heads, dim]` (padding rows zero).
    """
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    if not sequences:
        return out
    if not _has_flash(query):
        for i, sequence in enumerate(sequences):
            single = F.scaled_dot_product_attention(
                query[:, :, i : i + 1], sequence.key, sequence.value, scale=scale,
                enable_gqa=True)
            out[:, i : i + 1] = single.transpose(1, 2)
        return out
    num_heads, dim = query.shape[1], query.shape[3]
    kv_heads = sequences[0].key.shape[1]
    per_head = num_heads // kv_heads
    exact = sharing_is_exact(kv_heads, per_head, dim, query.dtype)
    for group in groups:
        for together in ([list(group)] if exact else [[i] for i in group]):
            _attend_group(query, sequences, together, scale, out, kv_heads, per_head)
    return out


def _attend_group(query: torch.Tensor, sequences: Sequence[SequenceKV], group: list[int],
                  scale: float, out: torch.Tensor, kv_heads: int, per_head: int) -> None:
    """Sequences with one shared part: that part in one call, then each one's rest, merged."""
    dim = query.shape[3]
    rows = [query[0, :, i].reshape(kv_heads, per_head, dim) for i in group]
    first = sequences[group[0]]
    split = first.split
    shared: tuple[torch.Tensor, torch.Tensor] | None = None
    if split:
        shared = _flash(torch.cat(rows, dim=1), first.key[:, :, :split],
                        first.value[:, :, :split], scale)
    for j, i in enumerate(group):
        sequence = sequences[i]
        own_out, own_lse = _flash(rows[j], sequence.key[:, :, split:],
                                  sequence.value[:, :, split:], scale)
        own_out, own_lse = own_out[:, :, :per_head], own_lse[:, :, :per_head]
        if shared is not None:
            part = slice(j * per_head, (j + 1) * per_head)
            own_out = _merge(shared[0][:, :, part].contiguous(),
                             shared[1][:, :, part].contiguous(),
                             own_out.contiguous(), own_lse.contiguous())
        out[0, i] = own_out[0].reshape(-1, dim)


def _flash(rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `rows` `[kv_heads, n, dim]` (padded to ROW_PAD) over one KV: out, lse."""
    kv_heads, n, dim = rows.shape
    padded = -(-n // ROW_PAD) * ROW_PAD
    query = rows.new_zeros(1, kv_heads, padded, dim)
    query[0, :, :n] = rows
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, scale=scale)
    return out, lse


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over keys A and B from each half's: weights sigmoid(lse_a - lse_b) and 1 - it."""
    weight_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1).to(out_a.dtype)
    return torch.lerp(out_b, out_a, weight_a)


def _has_flash(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


@functools.lru_cache(maxsize=16)
def sharing_is_exact(kv_heads: int, per_head: int, dim: int, dtype: torch.dtype) -> bool:
    """Whether a row's shared-part attention has the same bits in every group size (probe).

    Random queries for `MAX_SHARING` sequences over one random KV of two
    split blocks: each sequence's rows in every group of 1 to MAX_SHARING
    sequences, at every position, against its rows alone.
    """
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    key, value = randn(1, kv_heads, _PROBE_KEYS, dim), randn(1, kv_heads, _PROBE_KEYS, dim)
    rows = [randn(kv_heads, per_head, dim) for _ in range(MAX_SHARING)]
    with torch.inference_mode():
        alone = [_flash(r, key, value, 1.0) for r in rows]
        for size in range(2, MAX_SHARING + 1):
            chosen = list(range(MAX_SHARING - size, MAX_SHARING))[::-1]
            out, lse = _flash(torch.cat([rows[i] for i in chosen], dim=1), key, value, 1.0)
            for j, i in enumerate(chosen):
                part = slice(j * per_head, (j + 1) * per_head)
                if not (torch.equal(out[:, :, part], alone[i][0][:, :, :per_head])
                        and torch.equal(lse[:, :, part], alone[i][1][:, :, :per_head])):
                    return False
    return True
