"""A bounded cache of recently used entries, for passes over a whole store.

fsck reads every step once, and each step looks back at a few others (its
parent, its skip pointer's target, its lists' bases), nearly always recent
ones. `Recent` keeps the entries set or found lately in two generations of at
most `size` each: a full young generation becomes the old one and the
previous old one is dropped, and an entry found in the old generation moves
back to the young one. So memory stays under 2 x `size` entries however large
the store, and an entry used again and again (the root of a long run) stays.
A miss only costs the caller a read from the database. Values are never None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """At most 2 x `size` entries: those set or found most recently."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self._young: dict[K, V] = {}
        self._old: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        """The entry of `key`, or None when it is not kept (any more)."""
        value = self._young.get(key)
        if value is None:
            value = self._old.pop(key, None)
            if value is not None:
                self[key] = value
        return value

    def __getitem__(self, key: K) -> V:
        """The entry of `key`; KeyError when it is not kept (any more)."""
        try:
            return self._young[key]
        except KeyError:
            value = self._old.pop(key)  # KeyError: not kept
        self[key] = value
        return value

    def lookup(self) -> Callable[[K], V]:
        """A fast `__getitem__` for many lookups in a row (a walk): it looks in the young
        generation only, so a KeyError may mean an old entry; `revive` brings it back."""
        return self._young.__getitem__

    def revive(self, key: K) -> bool:
        """Move `key` from the old generation to the young one; whether it was there."""
        value = self._old.pop(key, None)
        if value is None:
            return False
        self[key] = value
        return True

    def missing(self, keys: Iterable[K]) -> set[K]:
        """The keys not kept; those in the old generation move to the young one."""
        absent = set(keys).difference(self._young)
        for key in [key for key in absent if key in self._old]:  # not .intersection(dict):
            self.revive(key)  # that walks the whole dict
        return absent.difference(self._young).difference(self._old)  # a move may swap them

    def set_all(self, keys: Iterable[K], value: V) -> None:
        """Set each of `keys` to `value`."""
        for key in keys:
            self[key] = value

    def __setitem__(self, key: K, value: V) -> None:
        self._young[key] = value
        if len(self._young) >= self.size:
            self._old, self._young = self._young, {}

    def __contains__(self, key: object) -> bool:
        return key in self._young or key in self._old

    def __len__(self) -> int:
        return len(self._young) + len(self._old)
