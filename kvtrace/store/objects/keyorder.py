"""The key order of a JSON value's objects, which the canonical encoding does not keep.

The store writes every value with its keys sorted (encoding.py: equal
values are equal bytes). Most readers do not care; an agent handed a
recorded tool result back (`kvtrace.replaying`) may: it often writes the
result into its next prompt with `json.dumps`, which follows the dict's
order, and one reordered key makes the prompt differ from the recorded one.
So a tool call keeps, beside its result, the order of each object whose
keys were not sorted already: `{JSON pointer: [key, ...]}` (RFC 6901
pointers, "" for the value itself), empty for most results, so most steps
are as before. `in_key_order` puts a value's keys back in that order, for
objects whose keys are still the recorded ones (an edited value is left as
it comes where its keys changed).
"""

from __future__ import annotations

from typing import Any


def key_order(value: Any) -> dict[str, list[str]]:
    """The order of the keys of each object in `value` not in sorted order, by JSON pointer."""
    orders: dict[str, list[str]] = {}
    _collect(value, "", orders)
    return orders


def in_key_order(value: Any, orders: dict[str, list[str]]) -> Any:
    """`value` with each object's keys in the order `orders` recorded (a copy, unless
    nothing was recorded)."""
    return _apply(value, "", orders) if orders else value


def _collect(value: Any, pointer: str, orders: dict[str, list[str]]) -> None:
    if isinstance(value, dict):
        keys = [str(key) for key in value]
        if keys != sorted(keys):
            orders[pointer] = keys
        for key, item in value.items():
            _collect(item, f"{pointer}/{_escaped(str(key))}", orders)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _collect(item, f"{pointer}/{index}", orders)


def _apply(value: Any, pointer: str, orders: dict[str, list[str]]) -> Any:
    if isinstance(value, dict):
        order = orders.get(pointer)
        keys = order if order is not None and sorted(order) == sorted(value) else list(value)
        return {key: _apply(value[key], f"{pointer}/{_escaped(key)}", orders) for key in keys}
    if isinstance(value, list):
        return [_apply(item, f"{pointer}/{index}", orders) for index, item in enumerate(value)]
    return value


def _escaped(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
