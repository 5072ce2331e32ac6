"""The key order of a tool result's objects, kept beside the sorted stored value."""

from __future__ import annotations

import json

from kvtrace.store.objects.keyorder import in_key_order, key_order

RETURNED = {"wrote": 3, "turn": 0, "lines": [{"text": "a", "at/~": 1}, {"a": 1, "b": 2}]}


def test_only_objects_out_of_sorted_order_are_kept():
    assert key_order(RETURNED) == {"": ["wrote", "turn", "lines"],
                                   "/lines/0": ["text", "at/~"]}
    assert key_order({"a": {"b": 1, "c": [1, 2]}}) == {}
    assert key_order("text") == {}


def test_a_sorted_copy_gets_its_order_back_to_the_byte():
    stored = json.loads(json.dumps(RETURNED, sort_keys=True))
    assert json.dumps(stored) != json.dumps(RETURNED)
    assert json.dumps(in_key_order(stored, key_order(RETURNED))) == json.dumps(RETURNED)


def test_an_object_whose_keys_changed_keeps_its_own_order():
    edited = {"note": "edited", "turn": 0}
    assert list(in_key_order(edited, key_order(RETURNED))) == ["note", "turn"]
