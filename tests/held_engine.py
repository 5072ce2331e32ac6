"""Hold a DecodeBatcher's engine thread until jobs queue behind it: concurrency without timing.

Tests that need requests decoded together (not merely sent together) start
them inside `engine_held(batcher, until_waiting=N)`: one `call` occupies the
engine thread until N jobs wait in its queue, and then all N are admitted
at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def engine_held(batcher: Any, *, until_waiting: int) -> Iterator[None]:
    """The engine thread busy in the block, and after it until `until_waiting` jobs wait."""
    gate, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        gate.wait()

    holder = threading.Thread(target=batcher.call, args=(hold,))
    holder.start()
    holding.wait()
    try:
        yield
        while batcher.num_waiting < until_waiting:
            time.sleep(0.01)
    finally:
        gate.set()
        holder.join(timeout=120)
