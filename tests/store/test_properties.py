"""Property-based tests (hypothesis) of what enters the store, on both backends.

- run names: a valid name round-trips (in NFC); anything else is an InvalidNameError;
- step addresses: resolving any text gives a step id or a KvtraceError, never a crash;
- JSON payloads: recording any value either round-trips exactly or is a UsageError,
  which writes nothing;
- bundles: importing an export with mutated bytes either is refused with a
  KvtraceError leaving the store unchanged (compared by a checksum of every row), or
  succeeds with fsck clean.

Settings are short for `make test` (`KVTRACE_HYPOTHESIS_EXAMPLES` raises them; the
figures in docs/reliability.md come from a long run).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import unicodedata

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvtrace import KvtraceError, UsageError
from kvtrace.errors import InvalidNameError
from kvtrace.store.names import validate_run_name

EXAMPLES = int(os.environ.get("KVTRACE_HYPOTHESIS_EXAMPLES", "40"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Text from every corner of Unicode: surrogates, NUL, format and combining characters.
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12) | st.sampled_from(
    ["main", "café", "cafe\u0301", "a\u200bb", "\ufeffx", "x\u202e", "a/b", "a..b", "-x", "x.lock",
     "main@1", "main~2", "\x00", "\ud800", "a" * 201, "ab/.c", "名前", "😀"]
)

JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**1100), max_value=2**1100)
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
)
JSON = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def _dump_checksum(store) -> str:
    """SHA-256 over every row of every kvtrace table, in key order."""
    digest = hashlib.sha256()
    with store.engine.connect() as conn:
        for table, key in (("blobs", "hash"), ("steps", "id"), ("refs", "name"),
                           ("reflog", "id"), ("notes", "id")):
            for row in conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY {key}")):
                digest.update(repr(tuple(row)).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _is_json_exact(value) -> bool:
    """Whether canonical JSON can hold `value` exactly (else recording must refuse it)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return value.bit_length() <= 1024
    if isinstance(value, str):
        return not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return all(_is_json_exact(v) for v in value)
    return all(_is_json_exact(k) and _is_json_exact(v) for k, v in value.items())


@SETTINGS
@given(name=TEXT)
def test_a_run_name_round_trips_in_nfc_or_is_an_invalid_name(store, name):
    try:
        valid = validate_run_name(name)
    except InvalidNameError:
        with pytest.raises(InvalidNameError):
            store.run(name)
        return
    assert valid == unicodedata.normalize("NFC", name)
    assert store.run(name).name == valid
    assert valid in {info.name for info in store.runs()}
    assert store.run(valid).record_tool_call("t", {}, 1).id == store.resolve(name)


@SETTINGS
@given(spec=TEXT | st.from_regex(r"[a-z]{1,4}[@~][0-9]{0,30}", fullmatch=True))
def test_resolving_any_text_gives_a_step_or_a_kvtrace_error(store, spec):
    if store.runs() == []:
        run = store.run("main")
        for i in range(3):
            run.record_tool_call("t", {"i": i}, i)
    try:
        step_id = store.resolve(spec)
    except KvtraceError:
        return
    assert len(step_id) == 64


@SETTINGS
@given(value=JSON, meta=JSON)
def test_a_json_payload_round_trips_exactly_or_is_a_usage_error(store, value, meta):
    run = store.run("main")
    before = run.head
    try:
        step = run.record("x", {"value": value}, meta={"m": meta})
    except UsageError:
        event("refused (UsageError)")
        assert not (_is_json_exact(value) and _is_json_exact(meta))
        assert store.head("main") == before
        return
    event("recorded and read back")
    assert _is_json_exact(value) and _is_json_exact(meta)
    shown = store.show(step.id)
    assert shown.content == {"value": value}
    if meta is not None:
        assert shown.meta == {"m": meta}
    assert _same(shown.content["value"], value)  # -0.0 stays -0.0, 1 stays an int


def _same(a, b) -> bool:
    """Equal in value and in JSON type (== alone takes 1 == 1.0 == True)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.fixture
def exported(store):
    run = store.run("main")
    step = run.record_model_call(
        [{"role": "user", "content": "2+2?"}], {"role": "assistant", "content": "4"}, model="m"
    )
    run.record_tool_call("calc", {"expr": "2+2"}, 4)
    store.note(step.id, "checked", author="me")
    buffer = io.BytesIO()
    store.export_run("main", buffer)
    return buffer.getvalue()


MUTATION = st.tuples(
    st.sampled_from(["flip", "delete", "insert", "truncate"]),
    st.floats(min_value=0, max_value=1, exclude_max=True),
    st.integers(min_value=0, max_value=255),
)


@SETTINGS
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_a_mutated_bundle_is_refused_whole_or_imports_soundly(store, exported, mutations):
    data = bytearray(exported)
    for kind, where, byte in mutations:
        at = int(where * len(data))
        if not data:
            break
        if kind == "flip":
            data[at] ^= byte or 1
        elif kind == "delete":
            del data[at]
        elif kind == "insert":
            data.insert(at, byte)
        else:
            del data[at:]
    if bytes(data) == exported:
        return
    before = _dump_checksum(store)
    name = f"copy{len(store.runs())}"  # a new name each time: a success is a real import
    try:
        store.import_bundle(io.BytesIO(bytes(data)), name=name)
    except KvtraceError as exc:
        event(f"refused ({type(exc).__name__})")
        assert _dump_checksum(store) == before
        return
    event("imported (a change outside the hashed content)")
    assert store.fsck().problems == []
