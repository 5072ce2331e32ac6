"""The canonical encoding is a contract: these ids must never change."""

from __future__ import annotations

import pytest

from kvtrace.errors import UsageError
from kvtrace.store.objects.encoding import (
    ENCODING_VERSION,
    canonical_json,
    decode_body,
    sha256_hex,
    step_body,
)


def _body(**overrides):
    fields = {
        "kind": "tool_call",
        "parent": None,
        "payload": {"result": "ab" * 32},
        "raw": [],
        "meta": {"tool": "calc"},
    }
    fields.update(overrides)
    return step_body(**fields)


def test_canonical_json_sorts_keys_and_is_compact():
    assert canonical_json({"b": 1, "a": [1, 2.5, None, True]}) == b'{"a":[1,2.5,null,true],"b":1}'


def test_canonical_json_keeps_unicode_as_utf8():
    assert canonical_json("é😀") == '"é😀"'.encode()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {1: "x"}, {"s": {1, 2}}, b"bytes"])
def test_canonical_json_rejects_values_without_one_spelling(bad):
    with pytest.raises(UsageError):
        canonical_json(bad)


def test_key_order_does_not_change_the_encoding():
    assert canonical_json({"x": 1, "y": 2}) == canonical_json({"y": 2, "x": 1})


def test_step_body_carries_the_version_tag():
    assert decode_body(_body())["v"] == ENCODING_VERSION == 2


def test_known_step_id_is_pinned():
    # If this fails, every stored id changed: bump ENCODING_VERSION instead.
    body = _body()
    assert body == (
        b'{"kind":"tool_call","lists":{},"meta":{"tool":"calc"},"parent":null,"payload":'
        b'{"result":"' + b"ab" * 32 + b'"},"raw":[],"v":2}'
    )
    assert sha256_hex(body) == "ea81166273b1a1bfc026e21c81fec7f93421460995d5d214f39bffc154166675"


def test_known_model_call_id_with_a_list_field_is_pinned():
    body = _body(kind="model_call", payload={"response": "ab" * 32}, meta={"model": "m"},
                 lists={"messages": {"base": None, "items": ["cd" * 32]}})
    assert sha256_hex(body) == "fd28703e7beffce956903185ef2a5617b5a735b6739e97d75a3ad5d6009df531"


def test_version_1_bodies_still_decode_with_their_pinned_id():
    v1 = (
        b'{"kind":"tool_call","meta":{"tool":"calc"},"parent":null,"payload":'
        b'{"result":"' + b"ab" * 32 + b'"},"raw":[],"v":1}'
    )
    assert sha256_hex(v1) == "5255c4a8208d9a266a95d916c3fd8a4fe095ed5bbf7dba5e6c459e6f01983598"
    assert decode_body(v1)["v"] == 1


@pytest.mark.parametrize("body", [
    b'{"kind":"t","lists":{},"meta":{},"parent":null,"payload":{},"raw":[],"v":1}',
    b'{"kind":"t","meta":{},"parent":null,"payload":{},"raw":[],"v":2}',
    b'{"kind":"t","lists":["x"],"meta":{},"parent":null,"payload":{},"raw":[],"v":2}',
    b'{"kind":"t","lists":{"x":{"base":null}},"meta":{},"parent":null,"payload":{},"raw":[],"v":2}',
    b'{"kind":"t","lists":{"x":{"base":"z","items":[]}},"meta":{},"parent":null,"payload":{},'
    b'"raw":[],"v":2}',
    b'{"kind":"t","meta":{},"parent":null,"payload":{},"raw":[],"v":3}',
    b'{"kind":"t","meta":{},"parent":null,"payload":{},"raw":[],"v":true}',
])
def test_bodies_of_the_wrong_shape_for_their_version_are_refused(body):
    from kvtrace.errors import IntegrityError

    with pytest.raises(IntegrityError):
        decode_body(body)


def test_parent_changes_the_id():
    assert sha256_hex(_body()) != sha256_hex(_body(parent="cd" * 32))


def test_content_changes_the_id():
    assert sha256_hex(_body()) != sha256_hex(_body(payload={"result": "ef" * 32}))
    assert sha256_hex(_body()) != sha256_hex(_body(meta={"tool": "calc2"}))
    assert sha256_hex(_body()) != sha256_hex(_body(kind="model_call"))


def test_decode_body_rejects_non_canonical_bytes():
    from kvtrace.errors import IntegrityError

    with pytest.raises(IntegrityError):
        decode_body(_body().replace(b":", b": ", 1))
