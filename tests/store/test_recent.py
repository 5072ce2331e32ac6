"""recent.py: the bounded cache fsck keeps its recent steps and blobs in."""

from __future__ import annotations

import pytest

from kvtrace.store.recent import Recent


def test_recent_keeps_at_most_two_generations_of_entries():
    recent: Recent[int, str] = Recent(3)
    for key in range(10):
        recent[key] = str(key)
    assert len(recent) <= 6 and [k for k in range(10) if k in recent] == [6, 7, 8, 9]


def test_recent_keeps_an_entry_found_again_past_its_generation():
    recent: Recent[int, str] = Recent(3)
    recent[0] = "root"
    for key in range(1, 20):
        recent[key] = str(key)
        assert recent[0] == "root"  # found at every step, as the root of a long run is


def test_recent_says_which_keys_it_does_not_keep():
    recent: Recent[int, str] = Recent(2)
    recent.set_all([1, 2, 3], "x")  # 1 and 2 now in the old generation
    assert recent.missing({1, 3, 4}) == {4}
    with pytest.raises(KeyError):
        recent[4]
