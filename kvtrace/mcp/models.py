"""The model behind the `replay`, `branch` and `analyze` tools: loaded once, used by one call
at a time.

The server's operator picks the model (`kvtrace mcp --model FOLDER`, default
the embedded one); a client never names a file to load. It is loaded on the
first call that computes with it, not at start, so a server that only
supervises never loads torch; and it stays loaded, with its KV cache in
memory, so a second replay of a prefix reuses the first's KV.

The engine is not shared between threads: a lock gives it (and its
tokenizer) to one tool call at a time (a second replay waits). What a call hands the replay API is a
stand-in that loads the model on its first use, after the API has checked
its input: a bad address fails at once, not after a model load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from kvtrace.replay.backend import Backend, Tokenizer

_log = logging.getLogger("kvtrace.mcp")


class Models:
    """The local backend (engine and two-tier KV cache) and its tokenizer, loaded on first use."""

    def __init__(self, model: str | None, *, cache_dir: Path) -> None:
        self.model = model
        self.cache_dir = cache_dir
        self._in_use = threading.Lock()  # one call computes with the engine at a time
        self._loading = threading.Lock()
        self._backend: Backend | None = None
        self._tokenizer: Tokenizer | None = None

    @contextmanager
    def backend(self) -> Iterator[Backend]:
        """The backend, for one call; other calls that want it wait until this one ends."""
        with self._in_use:
            yield cast("Backend", _OnFirstUse(self._load_backend))

    @contextmanager
    def tokenizer(self) -> Iterator[Tokenizer]:
        """The model's tokenizer (the loaded backend's, else loaded alone, without weights),
        for one call: a fast tokenizer is not to be used by two threads at once."""
        with self._in_use:
            yield cast("Tokenizer", _OnFirstUse(self._load_tokenizer))

    def _load_backend(self) -> Backend:
        with self._loading:
            if self._backend is None:
                from kvtrace.replay import open_local_backend

                # Tool calls come on any worker thread: the engine's own thread, which
                # loads it, is the one that keeps MKL's calls cheap (docs/batching.md).
                self._backend = open_local_backend(self.model, cache_dir=self.cache_dir,
                                                   on_convert=_announce, batching=True)
            return self._backend

    def _load_tokenizer(self) -> Tokenizer:
        with self._loading:
            if self._backend is not None:
                return cast("Tokenizer", self._backend.tokenizer)
            if self._tokenizer is None:
                from kvtrace.engine import load_tokenizer

                self._tokenizer = load_tokenizer(self.model, cache_dir=self.cache_dir,
                                                 on_convert=_announce)
            return self._tokenizer


class _OnFirstUse:
    """Stands for an object that `load` gives (seconds: a model) when first used."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._loaded: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._loaded is None:
            self._loaded = self._load()
        return getattr(self._loaded, name)


def _announce(message: str) -> None:
    """Told before the one-time conversion of the default model (~30 s): said on the log."""
    _log.warning("kvtrace: %s", message)
