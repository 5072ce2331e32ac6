"""Memory tier: token-exact radix tree, splits, LRU leaf eviction, pins, byte accounting."""

from __future__ import annotations

import torch

from kvtrace.engine import KVCache, prefill
from kvtrace.engine.radix import RadixTree

LAYERS, HEADS, DIM = 2, 2, 4
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * DIM * 4


def _source(tokens):
    """KV whose every row encodes its token id, so tests can check which rows came back."""

    def source(start, end):
        rows = torch.tensor(tokens[start:end], dtype=torch.float32)
        k = rows.view(1, 1, -1, 1).expand(LAYERS, HEADS, -1, DIM).contiguous()
        return k, -k

    return source


def _insert(tree, tokens):
    return tree.insert(tokens, _source(tokens))


def _rows(match):
    return [int(x) for k, _ in match.pieces() for x in k[0, 0, :, 0].tolist()]


def _recount(tree):
    total, stack = 0, list(tree.root.children.values())
    while stack:
        node = stack.pop()
        total += node.num_bytes
        stack.extend(node.children.values())
    return total


def test_lookup_is_token_exact_and_may_end_inside_a_segment():
    tree = RadixTree(max_bytes=10**9)
    _insert(tree, [1, 2, 3, 4, 5])
    match = tree.match([1, 2, 3, 9, 9])
    assert match.num_tokens == 3
    assert _rows(match) == [1, 2, 3]
    assert tree.match([2, 3]).num_tokens == 0


def test_insertion_splits_a_node_where_sequences_diverge():
    tree = RadixTree(max_bytes=10**9)
    assert _insert(tree, [1, 2, 3, 4, 5]) == 5
    assert _insert(tree, [1, 2, 3, 7, 8, 9]) == 3  # only the new tail is stored
    assert tree.num_nodes == 3
    assert _rows(tree.match([1, 2, 3, 4, 5])) == [1, 2, 3, 4, 5]
    assert _rows(tree.match([1, 2, 3, 7, 8, 9])) == [1, 2, 3, 7, 8, 9]
    assert tree.num_bytes == _recount(tree) == 8 * BYTES_PER_TOKEN


def test_eviction_is_lru_over_leaves_only():
    tree = RadixTree(max_bytes=10**9)
    _insert(tree, [1, 2, 3, 4])
    _insert(tree, [1, 2, 5, 6])
    _insert(tree, [9, 9])
    tree.match([1, 2, 3, 4])  # refresh: [5, 6] is now the oldest leaf
    tree.evict(tree.num_bytes - 1)
    assert tree.match([1, 2, 5, 6]).num_tokens == 2  # inner node [1, 2] kept
    assert tree.match([1, 2, 3, 4]).num_tokens == 4


def test_the_byte_budget_holds_under_a_stream_of_prompts(tiny_engine, tokens):
    budget = 300 * tiny_engine.kv_bytes_per_token
    cache = KVCache(tiny_engine, memory_bytes=budget)
    shared = tokens(40, seed=60)
    for seed in range(25):
        prefill(tiny_engine, cache, shared + tokens(30 + 7 * seed, seed=61 + seed))
        assert cache.memory.num_bytes <= budget
        assert cache.memory.num_bytes == _recount(cache.memory)
    assert cache.memory.num_evicted_tokens > 0


def test_pinned_nodes_are_never_evicted(tiny_engine, tokens):
    budget = 200 * tiny_engine.kv_bytes_per_token
    cache = KVCache(tiny_engine, memory_bytes=budget)
    kept = tokens(150, seed=80)
    prefill(tiny_engine, cache, kept)
    hit = cache.lookup(kept, max_tokens=149)  # pins the path
    assert hit.num_memory_tokens == 149

    for seed in range(6):
        prefill(tiny_engine, cache, tokens(120, seed=81 + seed))
        assert cache.memory.match(kept).num_tokens == 150

    cache.release(hit)
    prefill(tiny_engine, cache, tokens(120, seed=90))
    prefill(tiny_engine, cache, tokens(120, seed=91))
    assert cache.memory.match(kept).num_tokens == 0  # evicted once unpinned


def test_pins_survive_a_split_of_the_pinned_node():
    tree = RadixTree(max_bytes=10**9)
    _insert(tree, [1, 2, 3, 4])
    match = tree.match([1, 2, 3, 4])
    tree.pin(match.node)
    _insert(tree, [1, 2, 8])  # splits the pinned node
    tree.evict(0)
    assert tree.match([1, 2, 3, 4]).num_tokens == 4
    tree.unpin(match.node)
    tree.evict(0)
    assert tree.num_bytes == 0 and tree.num_nodes == 0


def _lend(tree, tokens, calls, lender=None):
    """Insert `tokens` as a loan from a source that counts the rows it is asked for."""
    inner = _source(tokens)

    def source(start, end):
        calls.append((start, end))
        return inner(start, end)

    return tree.insert(tokens, source, loan_bytes=BYTES_PER_TOKEN, lender=lender)


def test_a_borrowed_leaf_reads_its_rows_only_when_asked_and_splits_without_copying():
    tree, calls = RadixTree(max_bytes=10**9), []
    _lend(tree, [1, 2, 3, 4, 5, 6], calls)
    assert calls == []  # nothing copied at insertion
    assert tree.num_bytes == _recount(tree) == 6 * BYTES_PER_TOKEN

    _insert(tree, [1, 2, 3, 9])  # splits the borrowed leaf after 3 tokens
    assert calls == [] and tree.num_bytes == _recount(tree) == 7 * BYTES_PER_TOKEN
    assert _rows(tree.match([1, 2, 3, 4, 5, 6])) == [1, 2, 3, 4, 5, 6]
    assert calls == [(0, 3), (3, 6)]  # each half reads its own rows of the sequence


def test_repay_copies_only_the_rows_from_the_given_one():
    tree, calls = RadixTree(max_bytes=10**9), []
    _lend(tree, [1, 2, 3, 4], calls)
    _lend(tree, [1, 2, 3, 4, 5, 6, 7], calls)  # a second leaf, rows 4..7

    tree.repay(from_row=5)
    assert calls == [(5, 7)]  # the second leaf is split at 5 (no copy), its rest repaid
    calls.clear()
    assert _rows(tree.match([1, 2, 3, 4, 5, 6, 7])) == [1, 2, 3, 4, 5, 6, 7]
    assert calls == [(0, 4), (4, 5)]  # rows below 5 are still borrowed
    assert tree.num_bytes == _recount(tree) == 7 * BYTES_PER_TOKEN

    tree.repay()
    calls.clear()
    tree.match([1, 2, 3, 4, 5, 6, 7]).pieces()
    assert calls == [] and tree.num_bytes == _recount(tree) == 7 * BYTES_PER_TOKEN


def test_repay_of_one_lender_copies_only_its_loans():
    tree, calls = RadixTree(max_bytes=10**9), []
    first, second = object(), object()
    _lend(tree, [1, 2, 3, 4], calls, lender=first)
    _lend(tree, [1, 2, 7, 8, 9], calls, lender=second)  # splits the first's leaf: it keeps 3..4

    tree.repay(from_row=1, lender=second)
    assert calls == [(2, 5)]  # the second's own rows from 2: the shared ones are the first's
    calls.clear()
    assert _rows(tree.match([1, 2, 3, 4])) == [1, 2, 3, 4]
    assert calls == [(0, 2), (2, 4)]  # the first's loans are still borrowed
    assert tree.num_bytes == _recount(tree) == 7 * BYTES_PER_TOKEN
    calls.clear()
    tree.repay(from_row=3, lender=first)  # both halves of its split leaf are still its own
    assert calls == [(3, 4)]
