"""Blobs kept compressed (store/codec.py): addresses hash the content, readers and
bundles see the content, fsck decodes and re-hashes it; on both backends."""

from __future__ import annotations

import hashlib
import io

import pytest
import sqlalchemy as sa
import zstandard

from kvtrace import open_store
from kvtrace.errors import IntegrityError
from kvtrace.store import codec
from tests.conftest import tamper

LARGE = {"text": "the same sentence, again and again. " * 40}  # compresses well
SMALL = {"text": "short"}


def _kept(store, address: str) -> tuple[str | None, int, bytes]:
    with store.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT codec, size, data FROM blobs WHERE hash = :h"),
                           {"h": bytes.fromhex(address)}).one()
    return row.codec, row.size, bytes(row.data)


def test_a_large_blob_is_kept_compressed_under_the_hash_of_its_content(store):
    step = store.run("r").record_tool_call("t", {}, LARGE)
    address = step.payload["result"]
    content = store.read_blob(address)
    kept_as, size, data = _kept(store, address)
    assert kept_as == codec.ZSTD and size == len(content) and len(data) < len(content) // 4
    assert hashlib.sha256(content).hexdigest() == address
    assert store.show(step.id).content["result"] == LARGE


def test_a_small_blob_is_kept_as_it_is(store):
    step = store.run("r").record_tool_call("t", {}, SMALL)
    kept_as, _, data = _kept(store, step.payload["result"])
    assert kept_as is None and data == b'{"text":"short"}'


def test_content_that_does_not_shrink_is_kept_as_it_is():
    random_bytes = b"".join(hashlib.sha256(bytes([i])).digest() for i in range(16))  # 512 B
    assert codec.encode(random_bytes) == (random_bytes, None)
    assert codec.encode(random_bytes[:32] * 16)[1] == codec.ZSTD  # repeats shrink


def test_a_bundle_carries_the_content_and_keeps_every_id(store, store_urls):
    run = store.run("r")
    run.record_tool_call("t", LARGE, LARGE)
    run.record_model_call([{"role": "system", "content": LARGE["text"]},
                           {"role": "user", "content": "hi"}], "hello", model="m")
    bundle = io.BytesIO()
    store.export_run("r", bundle)
    other = open_store(store_urls())
    bundle.seek(0)
    other.import_bundle(bundle)
    assert [s.id for s in other.log("r")] == [s.id for s in store.log("r")]
    assert other.show("r").content["messages"][0]["content"] == LARGE["text"]
    assert other.fsck().problems == []
    other.close()


def test_fsck_re_hashes_the_decompressed_content(store):
    address = store.run("r").record_tool_call("t", {}, LARGE).payload["result"]
    size = len(store.read_blob(address))
    forged = zstandard.ZstdCompressor().compress(b'{"text":"' + b"x" * (size - 11) + b'"}')
    tamper(store, "UPDATE blobs SET data = :d WHERE hash = :h", d=forged, h=bytes.fromhex(address))
    assert any("does not hash to its address" in p for p in store.fsck().problems)


@pytest.mark.parametrize(("data", "kept_as", "problem"), [
    (b"not a zstd frame", "zstd", "does not decompress"),
    (None, "brotli", "codec 'brotli'"),
])
def test_fsck_reports_a_blob_it_cannot_decode(store, data, kept_as, problem):
    address = store.run("r").record_tool_call("t", {}, LARGE).payload["result"]
    if data is None:
        tamper(store, "UPDATE blobs SET codec = :c WHERE hash = :h", c=kept_as,
               h=bytes.fromhex(address))
    else:
        tamper(store, "UPDATE blobs SET data = :d WHERE hash = :h", d=data,
               h=bytes.fromhex(address))
    assert any(problem in p for p in store.fsck().problems)
    with pytest.raises(IntegrityError):
        store.read_blob(address)


def test_a_model_call_writes_only_the_messages_it_adds(store, monkeypatch):
    run = store.run("r")
    messages = [{"role": "system", "content": LARGE["text"]}, {"role": "user", "content": "q1"}]
    run.record_model_call(messages, "a1", model="m")
    offered: list[bytes] = []
    row = codec.row
    monkeypatch.setattr(codec, "row", lambda address, content: offered.append(content) or row(
        address, content))
    run.record_model_call(
        [*messages, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}],
        "a2", model="m")
    # The two new messages and the response, not the system prompt again.
    assert sorted(offered) == sorted([b'{"content":"a1","role":"assistant"}',
                                      b'{"content":"q2","role":"user"}',
                                      b'{"content":"a2","role":"assistant"}'])
