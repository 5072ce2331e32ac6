"""Token ids of a chat template's text, one segment at a time, each segment encoded once.

An agent's prompts grow: each model call sends the previous call's
conversation plus a few messages. Encoding every prompt whole costs the square
of a run's length (a 1,000-step run: ~350 MB of text through the tokenizer
for `analyze`). But a Hugging Face tokenizer first cuts its input at its
added tokens (`<|im_start|>`, `<|im_end|>`, ...) and encodes the text between
them piece by piece, each piece on its own. So the ids of a rendered prompt
are the ids of its pieces between *split tokens*, joined by the split
tokens' ids; a piece seen before (a message of an earlier call) is looked up,
not encoded again.

That identity holds only where the tokenizer really works so, so a split
token must be an added, special, unnormalized token that strips nothing and
that no other added token overlaps or contains (the tokenizer then matches it
wherever its text stands), and the pre-tokenizer must treat every piece
alike (a `Metaspace` that prepends only at the start of the text does not,
nor does a normalizer that prepends): otherwise `encoder_for` gives None and
the text is encoded whole. tests/engine/test_segments.py compares both ways
on conversations of every shape, special-token text in content included.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import OrderedDict
from typing import Any

_CACHE_CHARS = 64_000_000  # characters of pieces kept (their ids a few times that in bytes)
_encoders: weakref.WeakKeyDictionary[Any, SegmentEncoder | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class SegmentEncoder:
    """Encodes template text as `tokenizer(text, add_special_tokens=False)` does, piece by piece."""

    def __init__(self, tokenizer: Any, split_tokens: dict[str, int]) -> None:
        self._tokenizer = tokenizer
        self._ids = split_tokens
        # Longest first: at one position the longest split token wins, as in the tokenizer.
        self._pattern = re.compile("|".join(
            re.escape(token) for token in sorted(split_tokens, key=len, reverse=True)))
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    @property
    def split_tokens(self) -> frozenset[str]:
        """The added tokens the text is cut at."""
        return frozenset(self._ids)

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`, without special tokens added around it."""
        ids: list[int] = []
        start = 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                ids.extend(self._piece(text[start:match.start()]))
            ids.append(self._ids[match.group()])
            start = match.end()
        if start < len(text):
            ids.extend(self._piece(text[start:]))
        return ids

    def _piece(self, piece: str) -> tuple[int, ...]:
        with self._lock:
            found = self._pieces.get(piece)
            if found is not None:
                self._pieces.move_to_end(piece)
                return found
        found = tuple(int(t) for t in self._tokenizer.encode(piece, add_special_tokens=False))
        with self._lock:
            if piece not in self._pieces:
                self._pieces[piece] = found
                self._chars += len(piece)
            while self._chars > _CACHE_CHARS and self._pieces:
                dropped, _ = self._pieces.popitem(last=False)
                self._chars -= len(dropped)
        return found


def encoder_for(tokenizer: Any) -> SegmentEncoder | None:
    """The segment encoder of a Hugging Face tokenizer, or None when its pieces are not
    encoded independently (see the module docstring): then encode text whole."""
    with _lock:
        if tokenizer in _encoders:
            return _encoders[tokenizer]
    encoder = _build(tokenizer)
    with _lock:
        _encoders[tokenizer] = encoder
    return encoder


def _build(tokenizer: Any) -> SegmentEncoder | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return None  # not a fast tokenizer, or special-token text encoded as text
    # The parts it needs, not the whole tokenizer's JSON (`to_str` serialises the
    # vocabulary and merges: ~55 ms for the default model, on a server's first request).
    try:
        if "Metaspace" in _state(backend.pre_tokenizer) or "Prepend" in _state(backend.normalizer):
            return None
        added = [token for token in backend.get_added_tokens_decoder().items()
                 if isinstance(token[1].content, str) and token[1].content]
    except (ValueError, AttributeError):
        return None
    split = {token.content: int(token_id) for token_id, token in added
             if token.special and not token.normalized and not token.lstrip
             and not token.rstrip and not token.single_word}
    clashing = _overlapping([token.content for _, token in added], split)
    split = {text: token_id for text, token_id in split.items() if text not in clashing}
    return SegmentEncoder(tokenizer, split) if split else None


def _state(component: Any) -> str:
    """A tokenizer component's JSON ("" for none): what `to_str` would say of it."""
    return "" if component is None else component.__getstate__().decode()


def _overlapping(texts: list[str], candidates: dict[str, int]) -> set[str]:
    """The candidates that another added token's text contains, is contained in, or
    overlaps at an end (one's end is the other's start).

    By sets of substrings, prefixes and suffixes rather than pair by pair: Gemma 3's
    tokenizer has ~6,300 added tokens, and comparing every pair costs ~2 minutes.
    """
    distinct = set(texts)
    prefixes: dict[str, set[str]] = {}  # proper prefix -> the texts it starts
    suffixes: dict[str, set[str]] = {}  # proper suffix -> the texts it ends
    for text in distinct:
        for k in range(1, len(text)):
            prefixes.setdefault(text[:k], set()).add(text)
            suffixes.setdefault(text[-k:], set()).add(text)
    lengths = sorted({len(text) for text in distinct})
    joined = "\0".join(distinct)  # no token text holds NUL
    clashing: set[str] = set()
    for a in candidates:
        contained = joined.count(a) > 1  # a itself once, any more inside another text
        contains = any(a[i : i + n] in distinct for n in lengths if n < len(a)
                       for i in range(len(a) - n + 1))
        ends = any(prefixes.get(a[-k:], set()) - {a} or suffixes.get(a[:k], set()) - {a}
                   for k in range(1, len(a)))
        if contained or contains or ends:
            clashing.add(a)
    return clashing
