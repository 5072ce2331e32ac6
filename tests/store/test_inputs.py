"""Bad input is a UsageError naming what is wrong, the same on both backends, and
changes nothing; what is accepted can always be read back (issue 11, items 3, 5, 7-9).

Each test runs once per backend through the `store` fixture (tests/conftest.py).
"""

from __future__ import annotations

import base64
import io
import json
import types
import unicodedata

import pytest

from kvtrace import UsageError
from kvtrace.errors import InvalidNameError, InvalidSpecError, RunNotFoundError
from kvtrace.store.objects import encoding
from tests.conftest import tamper


def _nested(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def _bundle_lines(store, name="main") -> list[dict]:
    buffer = io.BytesIO()
    store.export_run(name, buffer)
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def _bundle(lines: list[dict]) -> io.BytesIO:
    return io.BytesIO(b"".join(json.dumps(line).encode() + b"\n" for line in lines))


# -- item 3: nesting, self-reference, huge ints, mappings -------------------------------


def test_a_payload_nested_up_to_the_limit_round_trips(store):
    deep = _nested(encoding.MAX_DEPTH - 1)  # plus the payload dict itself: MAX_DEPTH levels
    step = store.run("main").record("deep", {"value": deep})
    assert store.show(step.id).content["value"] == deep
    assert store.fsck().is_ok


@pytest.mark.parametrize("depth", [encoding.MAX_DEPTH + 1, 985, 5000])
def test_a_payload_nested_past_the_limit_is_refused_and_nothing_written(store, depth):
    run = store.run("main")
    with pytest.raises(UsageError, match="nested more than 256"):
        run.record("deep", {"value": _nested(depth)})
    assert store.head("main") is None and store.fsck().is_ok


def test_deeply_nested_meta_is_refused(store):
    with pytest.raises(UsageError, match="nested more than 256"):
        store.run("main").record("deep", {}, meta={"m": _nested(300)})


def test_a_container_inside_itself_is_refused(store):
    loop: list = [1]
    loop.append(loop)
    loop_dict: dict = {}
    loop_dict["me"] = loop_dict
    for value in (loop, loop_dict):
        with pytest.raises(UsageError, match="contains itself"):
            store.run("main").record("x", {"value": value})


def test_a_shared_but_not_cyclic_value_is_fine(store):
    shared = {"a": 1}
    step = store.run("main").record("x", {"value": [shared, shared]})
    assert store.show(step.id).content["value"] == [{"a": 1}, {"a": 1}]


def test_huge_integers_are_refused_and_wide_ones_round_trip(store):
    with pytest.raises(UsageError, match="bits"):
        store.run("main").record("x", {"value": 10**5000})
    wide = 2**1000 + 1
    step = store.run("main").record("x", {"value": wide})
    assert store.show(step.id).content["value"] == wide


def test_a_mapping_that_is_not_a_dict_is_refused_with_a_hint(store):
    with pytest.raises(UsageError, match="convert it to a dict"):
        store.run("main").record("x", {"value": types.MappingProxyType({"a": 1})})


@pytest.mark.parametrize("depth", [300, 5000])
def test_a_bundle_with_a_too_deep_payload_is_refused(store, depth):
    # Built by hand: the API refuses to record such a value in the first place.
    blob = b"[" * depth + b'"leaf"' + b"]" * depth
    address = encoding.sha256_hex(blob)
    body = encoding.step_body(kind="x", parent=None, payload={"value": address}, raw=[], meta={})
    step_id = encoding.sha256_hex(body)
    lines = [
        {"format": "kvtrace-bundle", "version": 1, "run": "deep", "head": step_id},
        {"blob": address, "data": base64.b64encode(blob).decode()},
        {"step": step_id, "body": body.decode(), "recorded_at": 1.0},
    ]
    with pytest.raises(UsageError, match="nested"):
        store.import_bundle(_bundle(lines))
    assert store.runs() == [] and store.fsck().num_blobs == 0


# -- item 5: timestamps in bundles --------------------------------------------------


@pytest.mark.parametrize("bad", [1e400, float("nan"), 1e300, -1e18, True, "0", None])
@pytest.mark.parametrize("field", ["recorded_at", "created_at"])
def test_a_bundle_with_an_insane_timestamp_is_refused(store, store_urls, bad, field):
    from kvtrace import open_store

    run = store.run("main")
    step = run.record_tool_call("t", {}, 1)
    store.note(step.id, "checked")
    lines = _bundle_lines(store)
    for line in lines:
        if field in line:
            line[field] = bad
    text = b"".join(
        json.dumps(line, allow_nan=True).encode() + b"\n" for line in lines
    )  # 1e400 is written as Infinity, NaN as NaN: what a hand-edited bundle may hold
    other = open_store(store_urls())
    with pytest.raises(UsageError, match=field):
        other.import_bundle(io.BytesIO(text), name="copy")
    assert other.runs() == [] and other.fsck().num_steps == 0
    other.close()


@pytest.mark.parametrize("bad", [1e300, -1e18, float("nan")])
def test_fsck_reports_an_insane_stored_timestamp(store, bad):
    step = store.run("main").record_tool_call("t", {}, 1)
    store.note(step.id, "checked")
    if bad != bad and store.engine.dialect.name == "sqlite":
        pytest.skip("SQLite stores NaN as NULL, which the column refuses")
    tamper(store, "UPDATE notes SET created_at = :t", t=bad)
    problems = store.fsck().problems
    assert any("created_at" in p and "not a time" in p for p in problems), problems


# -- item 7: one validation for both backends ----------------------------------------


@pytest.mark.parametrize(
    ("text", "author", "match"),
    [
        ("a\x00b", None, "NUL"),
        ("ok", "x" * 5000, "at most 200"),
        ("ok", "nul\x00", "NUL"),
        ("", None, "some text"),
        ("   ", None, "some text"),
        ("\ud800", None, "surrogate"),
    ],
)
def test_a_bad_note_is_refused_by_the_api_on_both_backends(store, text, author, match):
    step = store.run("main").record_tool_call("t", {}, 1)
    with pytest.raises(UsageError, match=match):
        store.note(step.id, text, author=author)
    assert store.notes(step.id) == []


@pytest.mark.parametrize(
    ("text", "author", "match"),
    [
        ("a\x00b", None, "NUL"),
        ("ok", "x" * 5000, "at most 200"),
        ("", None, "some text"),
        ("\ud800", None, "surrogate"),
    ],
)
def test_a_bundle_note_is_checked_like_an_api_note(store, store_urls, text, author, match):
    from kvtrace import open_store

    step = store.run("main").record_tool_call("t", {}, 1)
    store.note(step.id, "fine")
    lines = _bundle_lines(store)
    for line in lines:
        if "note" in line:
            line.update(text=text, author=author)
    other = open_store(store_urls())
    with pytest.raises(UsageError, match=match):
        other.import_bundle(_bundle(lines), name="copy")
    assert other.runs() == []
    other.close()


def test_a_nul_in_recorded_text_round_trips_on_both_backends(store):
    step = store.run("main").record("x", {"text": "a\x00b"}, meta={"m": "c\x00d"})
    shown = store.show(step.id)
    assert shown.content["text"] == "a\x00b" and shown.meta["m"] == "c\x00d"


# -- item 8: argument types --------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s.run(5), "run name must be a string"),
        (lambda s: s.run(None), "run name must be a string"),
        (lambda s: s.run("main").record("x", [1]), "payload must be a dict"),
        (lambda s: s.run("main").record("x", {"a": 1}, meta=[1]), "meta must be a dict"),
        (lambda s: s.run("main").record("x", {}, raw={"b": "str"}), "raw field 'b' must be"),
        (lambda s: s.run("main").record("x", {}, raw=[b"x"]), "raw must be a dict"),
        (lambda s: s.run("main").record("x", {1: "a"}), "field name must be a string"),
        (lambda s: s.run("main").record(5, {}), "bad step kind"),
        (lambda s: s.run("main").record("bad kind", {}), "bad step kind"),
        (lambda s: list(s.log("main", limit=0)), "at least 1"),
        (lambda s: list(s.log("main", limit="3")), "limit must be an int"),
        (lambda s: s.graph("main", limit=-1), "at least 1"),
        (lambda s: s.show(5), "step address must be a string"),
        (lambda s: s.head(5), "run name must be a string"),
        (lambda s: s.fork("main", 5), "run name must be a string"),
    ],
)
def test_wrong_argument_types_are_usage_errors_naming_the_parameter(store, call, match):
    store.run("main").record_tool_call("t", {}, 1)
    with pytest.raises(UsageError, match=match):
        call(store)
    assert store.head("main").depth == 1


def test_a_huge_log_limit_means_no_limit(store):
    run = store.run("main")
    for i in range(3):
        run.record_tool_call("t", {"i": i}, i)
    assert len(list(store.log("main", limit=99999999999999999999))) == 3


@pytest.mark.parametrize("spec", ["main@" + "9" * 5000, "main~" + "9" * 5000, "main@" + "9" * 19])
def test_a_huge_step_position_is_an_invalid_spec(store, spec):
    store.run("main").record_tool_call("t", {}, 1)
    with pytest.raises(InvalidSpecError, match="too large"):
        store.show(spec)


def test_a_position_with_leading_zeros_still_resolves(store):
    step = store.run("main").record_tool_call("t", {}, 1)
    assert store.resolve("main@" + "0" * 40 + "1") == step.id


# -- item 9: run names that deceive ---------------------------------------------------------


@pytest.mark.parametrize("char", ["\u200b", "\ufeff", "\u202e", "\u2066", "\u00ad"])
def test_run_names_with_format_characters_are_refused(store, char):
    with pytest.raises(InvalidNameError, match="format character"):
        store.run(f"ma{char}in")
    assert store.runs() == []


def test_composed_and_decomposed_names_are_one_run(store):
    composed = unicodedata.normalize("NFC", "café")
    decomposed = unicodedata.normalize("NFD", "café")
    assert composed != decomposed
    first = store.run(decomposed).record_tool_call("t", {}, 1)
    second = store.run(composed).record_tool_call("t", {}, 2)
    assert [info.name for info in store.runs()] == [composed]
    assert second.parent_id == first.id
    assert store.show(decomposed + "@1").id == first.id
    assert store.fork(decomposed, decomposed + "-2").name == composed + "-2"
    assert store.revert(decomposed, to=composed + "@1").id == first.id
    assert store.reflog(decomposed)[0].reason == "revert"


def test_an_unknown_run_is_not_found_not_a_type_error(store):
    with pytest.raises(RunNotFoundError):
        store.reflog("nosuch")


@pytest.mark.parametrize("depth", [300, 5000])
def test_a_too_deep_value_stored_before_the_limit_is_reported_not_a_crash(store, depth):
    from kvtrace.errors import IntegrityError
    from kvtrace.store.db.schema import blobs, reflog, refs, steps

    blob = b"[" * depth + b"1" + b"]" * depth
    address = encoding.sha256_hex(blob)
    body = encoding.step_body(kind="x", parent=None, payload={"v": address}, raw=[], meta={})
    step_id = encoding.sha256_hex(body)
    with store.engine.begin() as conn:  # what an older kvtrace let through
        conn.execute(blobs.insert().values(hash=address, size=len(blob), data=blob))
        conn.execute(steps.insert().values(id=step_id, parent_id=None, kind="x", depth=1,
                                           body=body, recorded_at=1.0))
        conn.execute(refs.insert().values(name="old", head=step_id, created_at=1.0))
        conn.execute(reflog.insert().values(ref="old", old_head=None, new_head=step_id,
                                            reason="create", message="old", created_at=1.0))
    problems = store.fsck().problems
    assert len(problems) == 1 and address[:12] in problems[0], problems
    if depth > 1000:  # past what Python's parser can read back at all
        with pytest.raises(IntegrityError):
            store.show("old")
