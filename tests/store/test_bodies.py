"""Step bodies kept packed (store/objects/bodies.py): ids hash the canonical body, every reader
and bundle sees it, fsck unpacks and re-hashes it, and steps kept before 0007 read as
they are; on both backends."""

from __future__ import annotations

import hashlib
import io

import pytest
import sqlalchemy as sa

from kvtrace import open_store
from kvtrace.errors import IntegrityError
from kvtrace.store.db.backend import _upgrade, create_db_engine
from kvtrace.store.objects import bodies, encoding
from tests.conftest import tamper

A, B = "ab" * 32, hashlib.sha256(b"b").hexdigest()


def _kept(store, step_id: str) -> tuple[str | None, bytes]:
    with store.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT body_codec, body FROM steps WHERE id = :i"),
                           {"i": bytes.fromhex(step_id)}).one()
    return row.body_codec, bytes(row.body)


@pytest.mark.parametrize("body", [
    encoding.step_body(kind="model_call", parent=A, payload={"response": B, "tools": A}, raw=[],
                       meta={"model": "m"}, lists={"messages": {"base": A, "items": [B, A]}}),
    encoding.step_body(kind="tool_call", parent=None, payload={"result": B}, raw=[],
                       meta={"tool": "t", "note": f'"{A}"', "quoted": f'\\"{B}\\"'}),
    encoding.step_body(kind="note", parent=B, payload={}, raw=[],
                       meta={"text": "café ☕ " + A.upper(), "edit_of": A, "hex63": A[:63]}),
    b'{"kind":"note","meta":{},"parent":null,"payload":{},"raw":[],"v":1}',  # version 1
], ids=["model_call", "addresses-in-strings", "unicode-and-near-misses", "v1"])
def test_a_packed_body_unpacks_to_its_canonical_bytes(body):
    data, kept_as = bodies.encode(body)
    assert bodies.decode(data, kept_as) == body
    if kept_as is not None:
        assert kept_as == bodies.PACKED and len(data) < len(body)


def test_bytes_that_are_not_utf8_are_kept_as_they_are():
    body = b'{"x":"\xff' + A.encode() + b'"}'
    assert bodies.encode(body) == (body, None)


def test_a_step_is_kept_packed_under_the_hash_of_its_canonical_body(store):
    run = store.run("r")
    run.record_model_call([{"role": "user", "content": "hi"}], "hello", model="m")
    step = run.record_tool_call("t", {"q": 1}, {"a": 2})
    kept_as, data = _kept(store, step.id)
    body = bodies.decode(data, kept_as)
    assert kept_as == bodies.PACKED and len(data) < len(body) // 2
    assert hashlib.sha256(body).hexdigest() == step.id
    assert store.show(step.id).content == {"arguments": {"q": 1}, "result": {"a": 2}}
    assert store.show("r@1").content["messages"] == [{"role": "user", "content": "hi"}]
    assert store.fsck().problems == []


def test_a_bundle_carries_canonical_bodies_and_keeps_every_id(store, store_urls):
    run = store.run("r")
    run.record_model_call([{"role": "user", "content": "hi"}], "hello", model="m")
    run.record_tool_call("t", {}, 1)
    bundle = io.BytesIO()
    store.export_run("r", bundle)
    assert b'"body": "{\\"kind\\":' in bundle.getvalue()  # canonical JSON, not the packed bytes
    other = open_store(store_urls())
    bundle.seek(0)
    other.import_bundle(bundle)
    assert [s.id for s in other.log("r")] == [s.id for s in store.log("r")]
    assert _kept(other, other.head("r").id)[0] == bodies.PACKED
    assert other.fsck().problems == []
    assert other.show("r@1").content["response"]["content"] == "hello"
    other.close()


@pytest.mark.parametrize(("data", "kept_as", "problem"), [
    (b"not a zstd frame", bodies.PACKED, "does not decode (tampered)"),
    (None, "brotli", "codec 'brotli'"),
])
def test_fsck_reports_a_body_it_cannot_unpack(store, data, kept_as, problem):
    step = store.run("r").record_tool_call("t", {}, 1)
    if data is None:
        tamper(store, "UPDATE steps SET body_codec = :c WHERE id = :i", c=kept_as,
               i=bytes.fromhex(step.id))
    else:
        tamper(store, "UPDATE steps SET body = :b WHERE id = :i", b=data, i=bytes.fromhex(step.id))
    assert any(problem in p and step.id[:12] in p for p in store.fsck().problems)
    with pytest.raises(IntegrityError):
        open_store(store.url).show(step.id)


def test_fsck_re_hashes_what_a_packed_body_unpacks_to(store):
    run = store.run("r")
    run.record_tool_call("t", {}, 1)
    step = run.record_tool_call("t", {}, 2)
    forged, kept_as = bodies.encode(bodies.decode(*reversed(_kept(store, step.id))).replace(
        b'"tool_call"', b'"note"'))
    tamper(store, "UPDATE steps SET body = :b WHERE id = :i", b=forged, i=bytes.fromhex(step.id))
    assert kept_as == bodies.PACKED
    assert any(step.id[:12] in p and "does not hash" in p for p in store.fsck().problems)


def test_steps_kept_before_0007_are_read_as_they_are(store_url):
    """A store at 0006 (bodies as canonical JSON, no codec column) migrates without a byte
    of its steps changing; they read and check as before, and new steps are packed."""
    engine = create_db_engine(store_url)
    parent = None
    with engine.begin() as conn:
        _upgrade(conn, "0006_refs_head_index")
        for depth in (1, 2):
            body = encoding.step_body(kind="note", parent=parent, payload={}, raw=[],
                                      meta={"d": depth, "ref": A})
            conn.execute(sa.text("INSERT INTO steps (id, parent_id, kind, depth, body, "
                                 "recorded_at) VALUES (:i, :p, 'note', :d, :b, 0)"),
                         {"i": encoding.sha256_hex(body), "p": parent, "d": depth, "b": body})
            parent = encoding.sha256_hex(body)
        conn.execute(sa.text("INSERT INTO refs (name, head, created_at) VALUES ('old', :h, 0)"),
                     {"h": parent})
        conn.execute(sa.text("INSERT INTO reflog (ref, old_head, new_head, reason, message, "
                             "created_at) VALUES ('old', NULL, :h, 'create', 'old', 0)"),
                     {"h": parent})
        before = {r.id: bytes(r.body) for r in conn.execute(sa.text("SELECT id, body FROM steps"))}
    engine.dispose()
    store = open_store(store_url)  # migrates 0006 -> head
    try:
        assert {i: _kept(store, i) for i in before} == {i: (None, b) for i, b in before.items()}
        assert store.show("old@2").meta == {"d": 2, "ref": A}
        new = store.run("old").record_note("new")
        assert _kept(store, new.id)[0] == bodies.PACKED and new.parent_id == parent
        assert store.fsck().problems == []
    finally:
        store.close()
