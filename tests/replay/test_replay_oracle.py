"""The oracle bound: longest prefix shared with any earlier sequence, capped at len - 1."""

from __future__ import annotations

import random

from kvtrace.replay.oracle import PrefixOracle, common_prefix_length


def _brute_force(seen: list[list[int]], query: list[int]) -> int:
    return max((common_prefix_length(query, s) for s in seen), default=0)


def test_common_prefix_length_counts_shared_leading_tokens():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([], [1]) == 0
    long = list(range(1000))
    assert common_prefix_length(long, [*long[:700], -1]) == 700
    assert common_prefix_length(long, long) == 1000


def test_oracle_matches_brute_force_over_random_branching_sequences():
    rng = random.Random(7)
    oracle, seen = PrefixOracle(), []
    base = [rng.randrange(5) for _ in range(300)]
    for _ in range(200):
        start = rng.choice(seen) if seen and rng.random() < 0.7 else base
        cut = rng.randrange(len(start) + 1)
        query = start[:cut] + [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
        assert oracle.longest_prefix(query).length == _brute_force(seen, query)
        oracle.add(query)
        seen.append(query)


def test_bound_leaves_the_last_prompt_token_to_compute():
    oracle = PrefixOracle()
    oracle.add([1, 2, 3, 4, 5])
    assert oracle.bound([1, 2, 3]) == 2
    assert oracle.bound([1, 2, 9, 9]) == 2
    assert oracle.bound([7]) == 0
    assert oracle.bound([]) == 0


def test_longest_prefix_names_the_sequence_it_came_from():
    oracle = PrefixOracle()
    oracle.add([1, 2, 3], label="a")
    oracle.add([1, 5, 6], label="b")
    assert oracle.longest_prefix([1, 5, 6, 7]).source == "b"
    assert oracle.longest_prefix([9]).source is None
