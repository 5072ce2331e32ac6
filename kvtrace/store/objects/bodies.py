"""How a step's body is kept: as it is, or packed.

A step's id is the SHA-256 of its canonical body (encoding.py), never of
what the `steps` row keeps, so keeping a body smaller changes no id. The
`steps.body_codec` column says how `body` holds it: NULL, the canonical
bytes themselves (every step written before migration 0007); `packed1`:

1. every 64-character hex address in quotes (`"<64 hex>"`: the parent, the
   payload's blobs, a list's base and items) replaced by the byte 0xFF and
   its 32 raw bytes. 0xFF never occurs in UTF-8, so the substitution is
   undone exactly, whatever the body says;
2. the result as one zstd frame (level 3, no magic number, checksum or
   dictionary id: the column names the format) compressed against
   `DICTIONARY`, a fixed sample of body keys, so that the keys every body
   repeats cost a few bytes instead of their length.

A body of 460 bytes, most of it hex, is kept in about 190
(docs/benchmarks.md). `packed1` pins the dictionary: a new dictionary is a
new codec. A body is packed only when that is smaller. Every row written goes through
`encode`, every read through `decode`; fsck decodes and re-hashes every
body, and a body that does not decode is an IntegrityError (a problem in
fsck's report), never a wrong body.
"""

from __future__ import annotations

import re
import threading
from binascii import unhexlify

import zstandard

from kvtrace.errors import IntegrityError

PACKED = "packed1"
CODECS = (PACKED,)
LEVEL = 3
MAX_SIZE = 64 << 20  # a body larger than this is refused when read back (no decompression bomb)

_MARK = b"\xff"
_ADDRESS = re.compile(rb'"([0-9a-f]{64})"')
_PACKED = re.compile(rb"\xff([\x00-\xff]{32})")
# Fixed for ever under the name `packed1`: the shapes of step bodies as kvtrace
# writes them (model calls, tool calls, HTTP exchanges, notes), addresses packed.
DICTIONARY = (
    b'{"kind":"http","lists":{},"meta":{"method":"POST","status":200,"url":"https://"},'
    b'"parent":\xff,"payload":{"request":\xff,"response":\xff},"raw":["body"],"v":2}'
    b'{"kind":"note","lists":{},"meta":{},"parent":\xff,"payload":{"text":\xff},"raw":[],"v":2}'
    b'{"kind":"tool_call","lists":{},"meta":{"call_id":"call_","error":"","tool":"",'
    b'"timings":{"total_s":0.}},"parent":\xff,"payload":{"arguments":\xff,"result":\xff},'
    b'"raw":[],"v":2}'
    b'{"kind":"model_call","lists":{"messages":{"base":null,"items":[\xff,\xff]}},'
    b'"meta":{"api":"openai-chat","extra":{},"model":"unknown","params":{"max_tokens":,'
    b'"temperature":0.},"request_model":"","timings":{"total_s":0.},"usage":{"cached_tokens":0,'
    b'"completion_tokens":,"prompt_tokens":,"total_tokens":}},"parent":null,'
    b'"payload":{"request":\xff,"response":\xff,"tools":\xff},"raw":[],"v":2}'
    b'{"kind":"model_call","lists":{"messages":{"base":\xff,"items":[\xff,\xff]}},'
    b'"meta":{"model":"unknown"},"parent":\xff,"payload":{"response":\xff,"tools":\xff},'
    b'"raw":[],"v":2}'
)

# zstandard's (de)compressor objects must not be used by two threads at once.
_local = threading.local()


def _dictionary() -> zstandard.ZstdCompressionDict:
    found = getattr(_local, "dictionary", None)
    if found is None:
        found = _local.dictionary = zstandard.ZstdCompressionDict(
            DICTIONARY, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    return found


def _compressor() -> zstandard.ZstdCompressor:
    found = getattr(_local, "compressor", None)
    if found is None:
        found = _local.compressor = zstandard.ZstdCompressor(
            level=LEVEL, dict_data=_dictionary(), write_checksum=False,
            write_content_size=True, write_dict_id=False)
    return found


def _decompressor() -> zstandard.ZstdDecompressor:
    found = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = zstandard.ZstdDecompressor(
            dict_data=_dictionary(), format=zstandard.FORMAT_ZSTD1_MAGICLESS)
    return found


def encode(body: bytes) -> tuple[bytes, str | None]:
    """What to keep for the canonical `body`: (data, codec), codec None when kept as it is."""
    if _MARK in body:  # not UTF-8, so not a body kvtrace writes: kept as it is
        return body, None
    parts = _ADDRESS.split(body)  # the text between addresses, and each address's hex
    for index in range(1, len(parts), 2):
        parts[index] = _MARK + unhexlify(parts[index])
    data = _compressor().compress(b"".join(parts))[4:]  # the magic number: the column says it
    if len(data) >= len(body):
        return body, None
    return data, PACKED


def decode(data: bytes, codec: str | None) -> bytes:
    """The canonical body of a step kept as `data` with `codec`."""
    if codec is None:
        return bytes(data)
    if codec != PACKED:
        raise IntegrityError(f"a step body is kept with codec {codec!r}, which this kvtrace "
                             f"does not know ({', '.join(CODECS)}): upgrade kvtrace")
    try:
        packed = _decompressor().decompress(bytes(data), max_output_size=MAX_SIZE)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"a packed step body does not decompress: {exc}") from exc
    return _PACKED.sub(lambda m: b'"' + m.group(1).hex().encode("ascii") + b'"', packed)
