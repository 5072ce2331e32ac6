"""Memory tier: a radix tree over token ids whose nodes hold KV (RadixAttention).

Each node owns a segment of tokens and the K and V of exactly those tokens
for every layer, as two tensors `[layers, kv_heads, segment, head_dim]`. The
path from the root to a node spells a token prefix; the KV of that prefix is
the concatenation of the segments along the path. Invariants:

- children of a node start with distinct tokens (keyed by first token id);
- lookups are token-exact and may end inside a segment (a partial node);
- insertion splits a node where a new sequence diverges, and the two halves
  get their own copies of the tensors so each half can be freed alone (or,
  borrowed, each borrows its own rows);
- eviction removes least-recently-used leaves only (an inner node's KV is
  the prefix of its children's) and never a pinned node; pins count
  upward so a pinned node keeps its whole path;
- `num_bytes` is the exact sum of the KV tensor sizes held (a loan counts
  as the copy it stands for).

Loans: a node may borrow its rows from one of the cache's live sequences (its
lender) instead of holding a copy (`insert(..., loan_bytes=..., lender=...)`):
the rows of the sequence an agent run keeps extending then exist once, in the
live buffers
(kvbuffer.py). Its rows are rows `start … start + n` of the sequence, read
through the lender (`Loan.source`) when someone needs them as tensors. The
owner of the buffers tells the tree, before it overwrites rows or lets them
go, to `repay` the loans reaching them: those nodes copy their rows then.

The tree is not thread-safe; `KVCache` serialises access.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# (start, end) -> (keys, values) for absolute token positions of the sequence
# being inserted, each `[layers, kv_heads, end - start, head_dim]`.
KVSource = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class Loan:
    """Rows `start …` of a sequence that a node borrows from `source` instead of copying."""

    source: KVSource
    start: int
    bytes_per_token: int
    lender: object = None  # who holds the rows (the cache's live buffers): repaid together


class RadixNode:
    """One segment of a cached token sequence (internal to the tree)."""

    __slots__ = (
        "children", "keys", "last_access", "loan", "num_pins", "parent", "tokens", "values",
    )

    def __init__(
        self,
        parent: RadixNode | None,
        tokens: tuple[int, ...],
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        loan: Loan | None = None,
    ) -> None:
        self.parent = parent
        self.tokens = tokens
        self.keys = keys
        self.values = values
        self.loan = loan
        self.children: dict[int, RadixNode] = {}
        self.num_pins = 0
        self.last_access = 0

    @property
    def num_bytes(self) -> int:
        if self.loan is not None:
            return len(self.tokens) * self.loan.bytes_per_token
        if self.keys is None or self.values is None:
            return 0
        return _tensor_bytes(self.keys) + _tensor_bytes(self.values)

    def kv(self, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV of this node's first `end` tokens (all by default): views, or a loan's copy."""
        n = len(self.tokens) if end is None else end
        if self.loan is not None:
            return self.loan.source(self.loan.start, self.loan.start + n)
        if self.keys is None or self.values is None:  # only the root has no KV
            raise RuntimeError("radix node without KV")
        if n == len(self.tokens):
            return self.keys, self.values
        return self.keys[:, :, :n], self.values[:, :, :n]

    def repay(self) -> None:
        """Copy the borrowed rows: the node holds its KV from here on."""
        if self.loan is not None:
            keys, values = self.kv()
            self.keys, self.values, self.loan = keys.contiguous(), values.contiguous(), None


@dataclass(frozen=True, slots=True)
class RadixMatch:
    """The longest cached prefix of a sequence: the nodes it runs through.

    `node` is the deepest node touched (pin it to keep the path alive in the
    tree); `path` holds each node with how many of its tokens match (the
    last one possibly cut inside its segment). Read `pieces()` before the
    tree changes: an insert may split a node of the path.
    """

    num_tokens: int
    node: RadixNode
    path: tuple[tuple[RadixNode, int], ...]

    def pieces(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The KV of the match in order: views of node tensors, copies of borrowed rows."""
        return tuple(node.kv(used) for node, used in self.path)


class RadixTree:
    """Token-exact prefix tree of KV segments under a byte budget."""

    def __init__(self, *, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.root = RadixNode(None, (), None, None)
        self.num_bytes = 0
        self.num_nodes = 0
        self.num_tokens = 0
        self.num_evicted_tokens = 0
        self._clock = itertools.count(1)
        self._loans: set[RadixNode] = set()  # nodes whose rows are borrowed

    def match(self, tokens: Sequence[int], *, max_tokens: int | None = None) -> RadixMatch:
        """Longest cached prefix of `tokens[:max_tokens]`; refreshes its LRU time."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        node, pos = self.root, 0
        path: list[tuple[RadixNode, int]] = []
        now = next(self._clock)
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = _common_length(child.tokens, tokens, pos, limit)
            child.last_access = now
            path.append((child, common))
            pos += common
            node = child
            if common < len(child.tokens):
                break
        self._touch_path(node, now)
        return RadixMatch(num_tokens=pos, node=node, path=tuple(path))

    def insert(
        self, tokens: Sequence[int], source: KVSource, *, loan_bytes: int | None = None,
        lender: object = None,
    ) -> int:
        """Make all of `tokens` cached, asking `source` only for the missing rows.

        With `loan_bytes` (bytes per token) the new leaf borrows its rows
        from `source` instead of copying them (module docstring), on behalf
        of `lender` (`repay` names it). Returns the
        number of tokens newly stored. May evict other leaves to stay under
        the budget (never pinned nodes, never the new leaf's path while it is
        referenced by a pin).
        """
        node, pos = self.root, 0
        now = next(self._clock)
        n = len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = _common_length(child.tokens, tokens, pos, n)
            if common < len(child.tokens):
                child = self._split(child, common)
            child.last_access = now
            pos += common
            node = child
        added = 0
        if pos < n:
            if loan_bytes is not None:
                loan = Loan(source, pos, loan_bytes, lender)
                leaf = RadixNode(node, tuple(tokens[pos:]), None, None, loan)
                self._loans.add(leaf)
            else:
                keys, values = source(pos, n)
                if keys.shape[2] != n - pos or values.shape[2] != n - pos:
                    raise ValueError("KV source returned the wrong number of rows")
                leaf = RadixNode(node, tuple(tokens[pos:]), keys.contiguous(), values.contiguous())
            leaf.last_access = now
            node.children[tokens[pos]] = leaf
            self.num_bytes += leaf.num_bytes
            self.num_nodes += 1
            self.num_tokens += n - pos
            added = n - pos
            node = leaf
        self._touch_path(node, now)
        self.evict(self.max_bytes)
        return added

    def pin(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction until `unpin`."""
        walk: RadixNode | None = node
        while walk is not None:
            walk.num_pins += 1
            walk = walk.parent

    def unpin(self, node: RadixNode) -> None:
        """Release one `pin` of `node` (and its ancestors)."""
        walk: RadixNode | None = node
        while walk is not None:
            if walk.num_pins <= 0:
                raise RuntimeError("unpin without a matching pin")
            walk.num_pins -= 1
            walk = walk.parent

    def repay(self, from_row: int = 0, *, lender: object = None) -> None:
        """Copy the rows of every loan reaching row `from_row` or past it (all by default),
        only `lender`'s when one is named.

        For the lender, before it overwrites those rows or lets them go.
        """
        for node in [n for n in self._loans if n.loan and n.loan.start + len(n.tokens) > from_row
                     and (lender is None or n.loan.lender is lender)]:
            if node.loan is not None and node.loan.start < from_row:
                # Rows below `from_row` stay borrowed: split there (no copy), repay the rest.
                self._split(node, from_row - node.loan.start)
            node.repay()
            self._loans.discard(node)

    def evict(self, max_bytes: int) -> int:
        """Drop LRU unpinned leaves until at most `max_bytes` remain; return bytes freed."""
        if self.num_bytes <= max_bytes:
            return 0
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.num_pins == 0]
        heapq.heapify(heap)
        freed = 0
        while self.num_bytes > max_bytes and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None:
                continue
            del parent.children[leaf.tokens[0]]
            size = leaf.num_bytes
            self.num_bytes -= size
            self.num_nodes -= 1
            self.num_tokens -= len(leaf.tokens)
            self.num_evicted_tokens += len(leaf.tokens)
            freed += size
            leaf.keys = leaf.values = leaf.loan = None
            leaf.parent = None
            self._loans.discard(leaf)
            if parent is not self.root and not parent.children and parent.num_pins == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def clear(self) -> None:
        """Forget everything, pinned or not (the caller must hold no pins)."""
        self._unlink()
        self.root = RadixNode(None, (), None, None)
        self.num_bytes = self.num_nodes = self.num_tokens = 0
        self._loans.clear()

    def __del__(self) -> None:
        self._unlink()

    def _unlink(self) -> None:
        """Free every node's KV now.

        A parent and its children refer to each other: left alone, a dropped
        tree's KV would wait for the cyclic collector.
        """
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.children, node.parent = {}, None
            node.keys = node.values = node.loan = None

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut `child` after `at` tokens; return the new upper node.

        The lower half keeps its identity (so pins held on it stay valid); the
        upper half inherits the pin count, since every path through the lower
        half runs through it.
        """
        parent = child.parent
        if parent is None:
            raise RuntimeError("cannot split the root")
        if child.loan is not None:  # both halves borrow: no copy
            loan = child.loan
            upper = RadixNode(parent, child.tokens[:at], None, None, loan)
            child.loan = Loan(loan.source, loan.start + at, loan.bytes_per_token, loan.lender)
            self._loans.add(upper)
        elif child.keys is None or child.values is None:
            raise RuntimeError("radix node without KV")
        else:
            upper = RadixNode(
                parent, child.tokens[:at], child.keys[:, :, :at].clone(),
                child.values[:, :, :at].clone(),
            )
            child.keys = child.keys[:, :, at:].clone()
            child.values = child.values[:, :, at:].clone()
        upper.num_pins = child.num_pins
        upper.last_access = child.last_access
        parent.children[child.tokens[0]] = upper
        child.tokens = child.tokens[at:]
        child.parent = upper
        upper.children[child.tokens[0]] = child
        self.num_nodes += 1
        return upper

    def _touch_path(self, node: RadixNode, now: int) -> None:
        walk: RadixNode | None = node
        while walk is not None and walk is not self.root:
            walk.last_access = now
            walk = walk.parent

    def _leaves(self) -> list[RadixNode]:
        leaves: list[RadixNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of `a` and `b`, up to `limit`."""
    n = min(len(a), len(b), limit)
    if list(a[:n]) == list(b[:n]):  # the usual case, at C speed
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _common_length(segment: Sequence[int], tokens: Sequence[int], start: int, limit: int) -> int:
    n = min(len(segment), limit - start)
    i = 0
    while i < n and segment[i] == tokens[start + i]:
        i += 1
    return i


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
