"""How a blob's bytes are kept (as they are, or compressed with zstd), written and read.

A blob's address is the SHA-256 of its *content*, never of what is kept, so
compressing changes nothing that a step id, a reader or a bundle sees. The
`blobs.codec` column says how `data` holds the content: NULL, the content
itself (every blob written before migration 0005, and small ones); `zstd`, a
zstd frame of it (level 3, content size in the frame header). `size` is
always the content's length.

A blob is compressed when it has at least MIN_SIZE bytes and compression
saves at least an eighth of them: below that, reading it back would pay a
decompression for next to nothing. fsck decodes every blob and re-hashes the
content; an unknown codec or a frame that does not decode to `size` bytes is
an IntegrityError, never wrong content. Every row written goes through
`row` and every read through `read` (fsck, which reports instead of
raising, through `decode`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
import zstandard
from sqlalchemy.engine import Connection

from kvtrace.errors import IntegrityError
from kvtrace.store.schema import blobs, is_address_text

ZSTD = "zstd"
CODECS = (ZSTD,)
MIN_SIZE = 128
LEVEL = 3

_IN_CHUNK = 500  # addresses per IN (...) list
# zstandard's (de)compressor objects must not be used by two threads at once.
_local = threading.local()


def encode(content: bytes) -> tuple[bytes, str | None]:
    """What to keep for `content`: (data, codec), codec None when kept as it is."""
    if len(content) < MIN_SIZE:
        return content, None
    compressor = getattr(_local, "compressor", None)
    if compressor is None:
        compressor = _local.compressor = zstandard.ZstdCompressor(level=LEVEL)
    data = compressor.compress(content)
    if len(data) > len(content) - len(content) // 8:
        return content, None
    return data, ZSTD


def decode(data: bytes, codec: str | None, size: int) -> bytes:
    """The content of a blob kept as `data` with `codec`; `size` is the content's length."""
    if codec is None:
        return data
    if codec != ZSTD:
        raise IntegrityError(f"a blob is kept with codec {codec!r}, which this kvtrace does "
                             f"not know ({', '.join(CODECS)}): upgrade kvtrace")
    decompressor = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    try:
        content = decompressor.decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"a zstd blob does not decompress: {exc}") from exc
    if len(content) != size:
        raise IntegrityError(f"a zstd blob decompresses to {len(content)} bytes, not {size}")
    return content


def row(address: str, content: bytes) -> dict[str, Any]:
    """The `blobs` row that keeps `content` at `address`."""
    data, codec = encode(content)
    return {"hash": address, "size": len(content), "codec": codec, "data": data}


def read(conn: Connection, addresses: Iterable[str]) -> dict[str, bytes]:
    """The content of each of these blobs that the store holds, by address."""
    wanted = sorted(a for a in set(addresses) if is_address_text(a))  # others are never kept
    found: dict[str, bytes] = {}
    for start in range(0, len(wanted), _IN_CHUNK):
        query = sa.select(blobs.c.hash, blobs.c.size, blobs.c.codec, blobs.c.data).where(
            blobs.c.hash.in_(wanted[start : start + _IN_CHUNK]))
        for address, size, codec, data in conn.execute(query):
            found[address] = decode(bytes(data), codec, size)
    return found
