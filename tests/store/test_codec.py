"""Blobs kept compressed (store/objects/codec.py): addresses hash the content, readers and
bundles see the content, fsck decodes and re-hashes it; on both backends."""

from __future__ import annotations

import hashlib
import io

import pytest
import sqlalchemy as sa
import zstandard

from kvtrace import open_store
from kvtrace.errors import IntegrityError
from kvtrace.store.objects import codec
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


def _bundled(store, run: str, other):
    """`other`, with run `run` of `store` imported into it through a bundle."""
    bundle = io.BytesIO()
    store.export_run(run, bundle)
    bundle.seek(0)
    other.import_bundle(bundle)
    return other


def test_a_bundle_carries_the_content_and_keeps_every_id(store, store_urls):
    run = store.run("r")
    run.record_tool_call("t", LARGE, LARGE)
    run.record_model_call([{"role": "system", "content": LARGE["text"]},
                           {"role": "user", "content": "hi"}], "hello", model="m")
    other = _bundled(store, "r", open_store(store_urls()))
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
    monkeypatch.setattr(codec, "row", lambda address, content, base=None: offered.append(
        content) or row(address, content, base))
    run.record_model_call(
        [*messages, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}],
        "a2", model="m")
    # The two new messages and the response, not the system prompt again.
    assert sorted(offered) == sorted([b'{"content":"a1","role":"assistant"}',
                                      b'{"content":"q2","role":"user"}',
                                      b'{"content":"a2","role":"assistant"}'])


# -- a tool result quoted in the next prompt: kept as a delta against the result ---------

RESULT = "".join(f"booking {hashlib.sha256(bytes([i])).hexdigest()[:24]}: seat {i}A\n"
                 for i in range(40))  # a tool output of ~1.5 KB, most of it kept by zstd alone


def _call_and_answer(run, result: str = RESULT):
    """A tool call with `result`, then the model call whose prompt carries it back."""
    tool = run.record_tool_call("search", {"q": "Oslo"}, result, call_id="call_1")
    asked = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "search", "arguments": "{\"q\": \"Oslo\"}"}}]}
    message = {"role": "tool", "tool_call_id": "call_1", "content": result}
    call = run.record_model_call([{"role": "user", "content": "Flights?"}, asked, message],
                                 "Here they are.", model="m")
    return tool, call, message


def _message_address(store, call, message) -> str:
    from kvtrace.apis.chat import normalize_message
    from kvtrace.store.objects.encoding import canonical_json, sha256_hex

    address = sha256_hex(canonical_json(normalize_message(message)))
    assert store.read_blob(address)  # the model call stored it under this address
    return address


def test_a_tool_result_quoted_by_the_next_prompt_is_kept_as_a_delta(store):
    tool, call, message = _call_and_answer(store.run("r"))
    address = _message_address(store, call, message)
    kept_as, _, data = _kept(store, address)
    plain, _ = codec.encode(store.read_blob(address))
    assert kept_as == codec.DELTA and data[:32].hex() == tool.payload["result"]
    assert len(data) < len(plain) // 4  # the result's bytes are not kept a second time
    assert store.show(call.id).content["messages"][2] == message
    assert hashlib.sha256(store.read_blob(address)).hexdigest() == address
    assert store.fsck().problems == []


def test_a_delta_is_written_with_its_base_even_when_the_base_was_rolled_back(store):
    from kvtrace.errors import StepNotFoundError

    run = store.run("r")
    with pytest.raises(RuntimeError), store.batch():
        result = run.record_tool_call("search", {"q": "Oslo"}, RESULT).payload["result"]
        raise RuntimeError("the import fails: nothing it wrote lands")
    with pytest.raises(StepNotFoundError):
        store.read_blob(result)
    # The store still remembers the result as a base: the delta brings its row along.
    quoted = {"role": "user", "content": "Again: " + RESULT}
    call = store.run("r2").record_model_call([quoted], "ok", model="m")
    kept_as, _, data = _kept(store, _message_address(store, call, quoted))
    assert kept_as == codec.DELTA and data[:32].hex() == result
    assert store.read_blob(result) and store.show(call.id).content["messages"] == [quoted]
    assert store.fsck().problems == []


def test_a_bundle_of_a_run_with_deltas_imports_whole(store, store_urls):
    _call_and_answer(store.run("r"))
    other = _bundled(store, "r", open_store(store_urls()))
    assert [s.content for s in other.log("r")] == [s.content for s in store.log("r")]
    assert other.fsck().problems == []
    other.close()


@pytest.mark.parametrize("damage", ["base content", "base missing", "a loop"])
def test_fsck_reports_a_delta_whose_base_is_damaged(store, damage):
    tool, call, message = _call_and_answer(store.run("r"))
    address, base = _message_address(store, call, message), tool.payload["result"]
    if damage == "base content":
        tamper(store, "UPDATE blobs SET data = :d, codec = NULL, size = 2 WHERE hash = :h",
               d=b'""', h=bytes.fromhex(base))
    elif damage == "base missing":
        tamper(store, "DELETE FROM blobs WHERE hash = :h", h=bytes.fromhex(base))
    else:  # the base made a delta of the delta: a reader must stop, not loop
        _, _, data = _kept(store, address)
        tamper(store, "UPDATE blobs SET codec = 'zstd-delta', data = :d WHERE hash = :h",
               d=bytes.fromhex(address) + data[32:], h=bytes.fromhex(base))
    problems = store.fsck().problems
    assert any(address[:12] in p and "delta" in p for p in problems), problems
    with pytest.raises(IntegrityError):
        store.read_blob(address)
    with pytest.raises(IntegrityError):
        store.show(call.id)
