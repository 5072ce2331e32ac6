"""How a blob's bytes are kept (as they are, compressed, or as a delta), written and read.

A blob's address is the SHA-256 of its *content*, never of what is kept, so
how a blob is kept changes nothing that a step id, a reader or a bundle
sees. The `blobs.codec` column says how `data` holds the content:

- NULL: the content itself (every blob written before migration 0005, and
  small ones);
- `zstd`: a zstd frame of it (level 3, content size in the frame header);
- `zstd-delta`: the 32 raw bytes of another blob's address (its *base*),
  then a zstd frame of the content compressed with the base's content as
  the dictionary (raw content, zstd's "prefix" mode). An agent's tool
  result is stored twice by design: as the tool step's `result` and inside
  the next model call's `tool` message, which the store keeps as a delta
  against the result (about a fifth of an imported trajectory's
  bytes). A delta is written in the same statement as its base's row, so
  the base exists wherever the delta does, and blobs are never deleted.

`size` is always the content's length. A blob is compressed when it has at
least MIN_SIZE bytes and compression saves at least an eighth of them;
below that, reading it back would pay a decompression for next to nothing.
A delta is kept when it also saves an eighth of what plain zstd keeps.

A read gets each delta's base in the same query (a self-join on the
address the delta starts with); a base that is itself a delta costs one
more query per link, MAX_CHAIN links at most (a writer makes chains of one,
so only a store written behind kvtrace's back has longer ones). fsck
decodes every blob and re-hashes the content; an unknown codec, a frame
that does not decode to `size` bytes, a missing base or a chain past
MAX_CHAIN is an IntegrityError, never wrong content. Every row written
goes through `row` and every read through `read` (fsck, which reports
instead of raising, through `decode_rows`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import sqlalchemy as sa
import zstandard
from sqlalchemy.engine import Connection

from kvtrace.errors import IntegrityError
from kvtrace.store.db.schema import blobs, is_address_text

ZSTD = "zstd"
DELTA = "zstd-delta"
CODECS = (ZSTD, DELTA)
MIN_SIZE = 128
LEVEL = 3
MAX_CHAIN = 4  # bases a read follows from one blob
_ADDRESS_BYTES = 32

_IN_CHUNK = 500  # addresses per IN (...) list
# zstandard's (de)compressor objects must not be used by two threads at once.
_local = threading.local()


class Base(NamedTuple):
    """A stored blob that a new one may be kept as a delta against."""

    address: str
    content: bytes


class Kept(NamedTuple):
    """A `blobs` row as read: how `data` keeps a content of `size` bytes."""

    size: int
    codec: str | None
    data: bytes


def encode(content: bytes, base: Base | None = None) -> tuple[bytes, str | None]:
    """What to keep for `content`: (data, codec), codec None when kept as it is.

    With `base`, the content is kept as a delta against it when that saves an
    eighth of what it would keep otherwise (a delta under an eighth of the
    content is taken at once: plain zstd does not shrink text that much).
    """
    if len(content) < MIN_SIZE:
        return content, None
    delta = None
    if base is not None:
        delta = bytes.fromhex(base.address) + zstandard.ZstdCompressor(
            level=LEVEL, dict_data=_dictionary(base.content)).compress(content)
        if len(delta) <= len(content) // 8:
            return delta, DELTA
    compressor = getattr(_local, "compressor", None)
    if compressor is None:
        compressor = _local.compressor = zstandard.ZstdCompressor(level=LEVEL)
    data: bytes = compressor.compress(content)
    codec: str | None = ZSTD
    if len(data) > len(content) - len(content) // 8:
        data, codec = content, None
    if delta is not None and len(delta) <= len(data) - len(data) // 8:
        return delta, DELTA
    return data, codec


def decode(kept: Kept, base: bytes | None = None) -> bytes:
    """The content of a blob kept as `kept`; `base` is its base's content (deltas only)."""
    if kept.codec is None:
        return kept.data
    if kept.codec not in CODECS:
        raise IntegrityError(f"a blob is kept with codec {kept.codec!r}, which this kvtrace "
                             f"does not know ({', '.join(CODECS)}): upgrade kvtrace")
    frame = kept.data
    if kept.codec == DELTA:
        if base is None:
            raise IntegrityError("a delta blob is decoded without its base")
        decompressor = zstandard.ZstdDecompressor(dict_data=_dictionary(base))
        frame = kept.data[_ADDRESS_BYTES:]
    else:
        decompressor = _plain_decompressor()
    try:
        content = decompressor.decompress(frame, max_output_size=kept.size)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"a {kept.codec} blob does not decompress: {exc}") from exc
    if len(content) != kept.size:
        raise IntegrityError(f"a {kept.codec} blob decompresses to {len(content)} bytes, "
                             f"not {kept.size}")
    return content


def base_of(kept: Kept) -> str | None:
    """The address of the blob `kept` is a delta against (None when it is not a delta)."""
    if kept.codec != DELTA:
        return None
    if len(kept.data) <= _ADDRESS_BYTES:
        raise IntegrityError("a delta blob is too short to name its base")
    return kept.data[:_ADDRESS_BYTES].hex()


def row(address: str, content: bytes, base: Base | None = None) -> dict[str, Any]:
    """The `blobs` row that keeps `content` at `address` (a delta against `base`, if smaller)."""
    data, codec = encode(content, base)
    return {"hash": address, "size": len(content), "codec": codec, "data": data}


def read(conn: Connection, addresses: Iterable[str]) -> dict[str, bytes]:
    """The content of each of these blobs that the store holds, by address."""
    decoded = decode_rows(conn, _rows(conn, addresses))
    for content in decoded.values():
        if isinstance(content, IntegrityError):
            raise content
    return {address: content for address, content in decoded.items()
            if not isinstance(content, IntegrityError)}


def decode_rows(conn: Connection,
                rows: Mapping[str, Kept]) -> dict[str, bytes | IntegrityError]:
    """The content of each row in `rows` (address -> how it is kept), or why it cannot be
    decoded: the bases of deltas are read from the store, a round of queries per link."""
    known = dict(rows)
    missing: set[str] = set()
    for _ in range(MAX_CHAIN):
        wanted = set()
        for kept in known.values():
            try:
                base = base_of(kept)
            except IntegrityError:
                continue
            if base is not None and base not in known and base not in missing:
                wanted.add(base)
        if not wanted:
            break
        found = _rows(conn, wanted)
        known.update(found)
        missing.update(wanted - set(found))
    decoded: dict[str, bytes] = {}  # contents only: an error may depend on where a chain began
    return {address: _content(address, known, missing, decoded) for address in rows}


def _content(address: str, known: Mapping[str, Kept], missing: set[str],
             decoded: dict[str, bytes], links: int = 0) -> bytes | IntegrityError:
    """The content at `address`, decoding the bases it stands on first."""
    if address in decoded:
        return decoded[address]
    try:
        kept = known[address]
        base = base_of(kept)
        base_content = None
        if base is not None:
            if base in missing:
                raise IntegrityError(f"the base {base[:12]} of a delta blob is missing")
            if links >= MAX_CHAIN or base not in known:
                raise IntegrityError(f"a delta blob stands on more than {MAX_CHAIN} bases")
            found = _content(base, known, missing, decoded, links + 1)
            if isinstance(found, IntegrityError):
                raise IntegrityError(f"the base {base[:12]} of a delta blob cannot be read: "
                                     f"{found}")
            base_content = found
        content = decode(kept, base_content)
    except IntegrityError as exc:
        return exc
    decoded[address] = content
    return content


def _rows(conn: Connection, addresses: Iterable[str]) -> dict[str, Kept]:
    """How each of these blobs that the store holds is kept, by address, and with each
    delta its base's row (joined in the same query: a read takes no extra round for them)."""
    wanted = sorted(a for a in set(addresses) if is_address_text(a))  # others are never kept
    found: dict[str, Kept] = {}
    for start in range(0, len(wanted), _IN_CHUNK):
        query = _ROWS_WITH_BASES.where(blobs.c.hash.in_(wanted[start : start + _IN_CHUNK]))
        for address, size, codec, data, base, base_size, base_codec, base_data in conn.execute(
                query):
            found[address] = Kept(size, codec, bytes(data))
            if base is not None:
                found.setdefault(base, Kept(base_size, base_codec, bytes(base_data)))
    return found


_base = blobs.alias("base")
_ROWS_WITH_BASES = sa.select(
    blobs.c.hash, blobs.c.size, blobs.c.codec, blobs.c.data,
    _base.c.hash, _base.c.size, _base.c.codec, _base.c.data,
).outerjoin(_base, sa.and_(blobs.c.codec == DELTA,
                           _base.c.hash == sa.func.substr(blobs.c.data, 1, _ADDRESS_BYTES)))


def _plain_decompressor() -> zstandard.ZstdDecompressor:
    decompressor = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def _dictionary(base: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
