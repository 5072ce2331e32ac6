"""Which stored blob a new message is kept as a delta against (codec.py's `zstd-delta`).

An agent's tool result reaches the store twice: as the `result` of its
tool_call step, then quoted inside the `tool` message (or a `tool_result`
block) of the next model call's prompt. The two blobs differ (the message
wraps the result), so addresses cannot share them; a zstd delta of the
message against the result keeps the second copy in a few dozen bytes.

A store remembers the last few payload blobs it wrote (`RecentPayloads`);
each new list item (a message) that quotes one of them, found by a 32-byte
window from the middle of the payload, is offered to the codec as a delta
against it, and the codec keeps the delta only if it is smaller. The base's
row goes into the same statement as the delta (ignored where the store holds
it already), so a delta never stands on a blob that a rolled-back
transaction took away.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from kvtrace.store.objects import codec

MAX_BASES = 8  # tool results of one turn (parallel tool calls) and a few more
MAX_BASE_BYTES = 1 << 20  # a larger payload is not kept around as a base
_WINDOW = 32


class RecentPayloads:
    """The payload blobs this store wrote last, newest first, each with its `blobs` row;
    thread-safe."""

    def __init__(self) -> None:
        self._bases: deque[tuple[bytes, codec.Base, dict[str, Any]]] = deque(maxlen=MAX_BASES)
        self._lock = threading.Lock()

    def note(self, rows: Iterable[dict[str, Any]], payloads: Mapping[str, bytes]) -> None:
        """Remember the payload blobs of a step written just now (address -> content), with
        their rows among `rows` (what `rows` gave for the step)."""
        usable = {address: content for address, content in payloads.items()
                  if codec.MIN_SIZE <= len(content) <= MAX_BASE_BYTES}
        if not usable:
            return
        kept = {row["hash"]: row for row in rows}
        with self._lock:
            for address, content in usable.items():
                if address in kept:
                    middle = len(content) // 2 - _WINDOW // 2
                    self._bases.appendleft((content[middle : middle + _WINDOW],
                                            codec.Base(address, content), kept[address]))

    def base_for(self, content: bytes) -> tuple[codec.Base, dict[str, Any]] | None:
        """The newest remembered blob that `content` quotes, and its row, if any."""
        if len(content) < codec.MIN_SIZE:
            return None
        with self._lock:
            bases = list(self._bases)
        return next(((base, row) for window, base, row in bases if window in content), None)

    def rows(self, blob_rows: Mapping[str, bytes], items: Iterable[str]) -> list[dict[str, Any]]:
        """The `blobs` rows for `blob_rows` (address -> content), in address order (writers
        sharing blobs then lock rows in one order); each of `items` (list items' addresses)
        may be kept as a delta, with its base's row beside it."""
        offered = set(items)
        rows: dict[str, dict[str, Any]] = {}
        for address, content in blob_rows.items():
            found = self.base_for(content) if address in offered else None
            if found is None or found[0].address == address:
                rows[address] = codec.row(address, content)
                continue
            base, base_row = found
            rows[address] = codec.row(address, content, base)
            if rows[address]["codec"] == codec.DELTA:
                rows.setdefault(base.address, base_row)
        return [rows[address] for address in sorted(rows)]
