"""Property-based tests (hypothesis) of every importer, on both backends.

One property per format (openai, atif, otel, claude-code, codex): a generated
document (for the agents' logs, a list of lines written as JSONL), given
as a file's bytes, either imports, and then its export imports again to
steps of the same content (kind, content, tool, call id, error, model), or
is refused with a UsageError that writes nothing (row counts of every table
unchanged). Any other exception fails the test. The generators build
documents of the format's shape, mutated at every level: wrong types,
duplicated and dangling ids, unknown roles and sources, NaN, lone
surrogates, deep nesting, huge integers, and plain garbage in place of any
element. Bundles are fuzzed in tests/store/test_properties.py.

Settings are short for `make test` (`KVTRACE_HYPOTHESIS_EXAMPLES` raises them;
the counts in docs/reliability.md come from a long run).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from kvtrace.errors import UsageError
from kvtrace.formats import export_file, import_file
from kvtrace.formats.otel import any_value

EXAMPLES = int(os.environ.get("KVTRACE_HYPOTHESIS_EXAMPLES", "30"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)
_RUNS = itertools.count()

# -- values ---------------------------------------------------------------------

TEXT = st.text(max_size=6) | st.sampled_from(
    ["", "ok", "[1, 2]", '{"a": 1}', "\x00", "\u202e", "名前", "null"])
HOSTILE = st.sampled_from([float("nan"), float("inf"), 10**400, 2**70, "\ud800"]) | st.integers(
    240, 300).map(lambda n: json.loads("[" * n + "]" * n))  # NaN, huge, deep: rarely storable
LEAF = (st.none() | st.booleans() | st.integers(-3, 3) | TEXT
        | st.floats(allow_nan=False, allow_infinity=False, width=32))
JSON = st.recursive(
    LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`strategy`, or once in 40 draws any JSON value in its place."""
    # Draws in the middle of the range: hypothesis favours a range's ends, and shrinks
    # towards its start, so to the well-formed document.
    return st.integers(1, 400).flatmap(lambda n: JSON if 190 <= n < 200 else strategy)


def _planted(document: Any, value: Any, position: int) -> Any:
    """`document` with `value` in place of one of its elements (the position-th of a walk)."""
    slots: list[tuple[Any, Any]] = []  # (container, key)
    pending = [document]
    while pending:
        item = pending.pop()
        keys = list(item) if isinstance(item, dict) else range(len(item)) if isinstance(
            item, list) else []
        for key in keys:
            slots.append((item, key))
            pending.append(item[key])
    if not slots:
        return value
    container, key = slots[position % len(slots)]
    container[key] = value
    return document


def hostile(document: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`document`, or once in sixteen draws with one element replaced by a value the store
    refuses (NaN, infinity, a huge integer, a lone surrogate, deep nesting)."""
    planted = st.builds(_planted, document, HOSTILE, st.integers(0, 10**6))
    return st.integers(1, 16).flatmap(lambda n: planted if n == 8 else document)


def obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> Any:
    """An object of the given fields (each possibly replaced), or now and then garbage."""
    fields = st.fixed_dictionaries({k: maybe(v) for k, v in required.items()},
                                   optional={k: maybe(v) for k, v in (optional or {}).items()})
    return maybe(fields)


IDS = st.sampled_from(["c1", "c2", "c3"])
NAMES = st.sampled_from(["f", "g", "calc"])
PART = obj({"type": st.sampled_from(["text", "image_url"]), "text": TEXT})
CONTENT = st.none() | TEXT | st.lists(PART, max_size=2)
ARGUMENTS = st.sampled_from(
    ["{}", '{"x": 1}', '{"x":1}', " {}", '"s"', "null", "not json", "", "[1]", "NaN", "1e400",
     "[" * 300 + "]" * 300, "[" * 5000 + "]" * 5000]) | st.dictionaries(
    st.sampled_from(["x", "y"]), JSON, max_size=2)

# -- documents ------------------------------------------------------------------

OPENAI_CALL = obj({"id": IDS, "type": st.just("function"),
                   "function": obj({"name": NAMES, "arguments": ARGUMENTS})})
OPENAI_ANSWER = obj({"role": st.just("assistant"), "content": CONTENT},
                    {"tool_calls": st.lists(OPENAI_CALL, max_size=3), "reasoning_content": TEXT})
OPENAI_MESSAGE = st.one_of(
    OPENAI_ANSWER, OPENAI_ANSWER, OPENAI_ANSWER,
    obj({"role": st.just("tool"), "content": CONTENT}, {"tool_call_id": IDS, "name": NAMES}),
    obj({"role": st.sampled_from(["system", "user", "developer", "exit", "robot"]),
         "content": CONTENT}, {"extra": JSON, "name": TEXT}),
)
OPENAI_TOOLS = st.lists(obj({"type": st.just("function"),
                             "function": obj({"name": NAMES}, {"parameters": JSON})}), max_size=2)
OPENAI_MESSAGES = st.lists(OPENAI_MESSAGE, min_size=1, max_size=7)
OPENAI = hostile(maybe(OPENAI_MESSAGES | obj(
    {"messages": OPENAI_MESSAGES}, {"model": TEXT, "tools": OPENAI_TOOLS, "info": JSON})))

ATIF_CALL = obj({"tool_call_id": IDS, "function_name": NAMES,
                 "arguments": st.none() | st.dictionaries(st.sampled_from(["x", "y"]), JSON)},
                {"extra": JSON})
ATIF_RESULT = obj({"content": CONTENT}, {"source_call_id": st.none() | IDS, "extra": JSON})
ATIF_METRICS = obj({}, {"prompt_tokens": st.integers(0, 9), "completion_tokens": st.integers(0, 9),
                        "cached_tokens": st.integers(0, 9), "cost_usd": st.floats(0, 1),
                        "completion_token_ids": st.lists(st.integers(0, 9), max_size=2),
                        "extra": JSON})
ATIF_STEP = obj(
    {"source": st.sampled_from(["system", "user", "agent", "agent", "agent"]),
     "message": TEXT | st.lists(PART, max_size=2)},
    {"step_id": st.integers(1, 9), "timestamp": TEXT, "model_name": TEXT,
     "reasoning_content": TEXT, "tool_calls": st.lists(ATIF_CALL, max_size=3),
     "observation": obj({"results": st.lists(ATIF_RESULT, max_size=3)}),
     "metrics": ATIF_METRICS, "extra": JSON})
ATIF = hostile(obj(
    {"schema_version": st.sampled_from(["ATIF-v1.0", "ATIF-v1.4", "ATIF-v1.6", "ATIF-v1.7"]),
     "agent": obj({"name": TEXT, "version": TEXT},
                  {"model_name": TEXT, "tool_definitions": OPENAI_TOOLS, "extra": JSON}),
     "steps": st.lists(ATIF_STEP, min_size=1, max_size=6)},
    {"session_id": TEXT, "notes": TEXT, "final_metrics": JSON, "extra": JSON}))

OTEL_PART = st.one_of(
    obj({"type": st.just("text"), "content": TEXT}),
    obj({"type": st.just("reasoning"), "content": TEXT}),
    obj({"type": st.just("tool_call"), "id": IDS, "name": NAMES}, {"arguments": ARGUMENTS}),
    obj({"type": st.just("tool_call_response"), "id": IDS}, {"response": JSON}),
    obj({"type": st.just("image"), "url": TEXT}),
)
OTEL_MESSAGE = obj({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                    "parts": st.lists(OTEL_PART, max_size=3)})
OTEL_ANSWER = obj({"role": st.just("assistant"), "parts": st.lists(OTEL_PART, max_size=3)})
OTEL_CHAT = obj(
    {"gen_ai.operation.name": st.just("chat"),
     "gen_ai.input.messages": st.lists(OTEL_MESSAGE, max_size=3),
     "gen_ai.output.messages": st.lists(OTEL_ANSWER, min_size=1, max_size=2)},
    {"gen_ai.request.model": TEXT, "gen_ai.system_instructions": st.lists(OTEL_PART, max_size=2),
     "gen_ai.usage.input_tokens": st.integers(0, 9), "gen_ai.usage.output_tokens": JSON,
     "gen_ai.response.finish_reasons": st.lists(TEXT, max_size=2),
     "gen_ai.request.temperature": st.floats(0, 2), "gen_ai.tool.definitions": OPENAI_TOOLS,
     "custom.attribute": JSON})
OTEL_TOOL = obj({"gen_ai.operation.name": st.just("execute_tool")},
                {"gen_ai.tool.name": NAMES, "gen_ai.tool.call.id": IDS,
                 "gen_ai.tool.call.arguments": ARGUMENTS | JSON, "gen_ai.tool.call.result": JSON})
SPAN_IDS = st.sampled_from(["a1", "a2", "a3", "a4", ""])


def _attributes(values: Any) -> Any:
    if not isinstance(values, dict):
        return values
    return [{"key": key, "value": any_value(value)} for key, value in values.items()]


OTEL_SPAN = obj(
    {"name": st.sampled_from(["chat m", "execute_tool f", "other"]),
     "attributes": st.one_of(OTEL_CHAT, OTEL_CHAT, OTEL_TOOL, OTEL_TOOL,
                             st.dictionaries(TEXT, JSON, max_size=2)).map(_attributes)},
    {"traceId": st.sampled_from(["t1"] * 9 + ["t2"]), "spanId": SPAN_IDS,
     "parentSpanId": SPAN_IDS,
     "startTimeUnixNano": st.integers(0, 3 * 10**9).map(str),
     "endTimeUnixNano": st.integers(0, 3 * 10**9).map(str),
     "status": obj({"code": st.sampled_from([0, 1, 2])}, {"message": TEXT})})
OTEL = hostile(obj({"resourceSpans": st.lists(obj({"scopeSpans": st.lists(
    obj({"spans": st.lists(OTEL_SPAN, min_size=1, max_size=5)}), min_size=1, max_size=2)}),
    min_size=1, max_size=2)}))

UUIDS = st.sampled_from(["u1", "u2", "u3", "u4", "u5", "u6"])
CC_BLOCK = st.one_of(
    obj({"type": st.just("text"), "text": TEXT}),
    obj({"type": st.just("thinking"), "thinking": TEXT}, {"signature": TEXT}),
    obj({"type": st.just("tool_use"), "id": IDS, "name": NAMES,
         "input": st.dictionaries(st.sampled_from(["x", "y"]), JSON, max_size=2)}),
)
CC_RESULT = obj({"type": st.just("tool_result"), "tool_use_id": IDS},
                {"content": TEXT | st.lists(PART, max_size=2), "is_error": st.booleans()})
CC_USAGE = obj({"input_tokens": st.integers(0, 9)},
               {"cache_read_input_tokens": st.integers(0, 99),
                "cache_creation_input_tokens": st.integers(0, 99),
                "output_tokens": st.integers(0, 9)})
CC_LINE = st.one_of(
    obj({"type": st.just("assistant"), "uuid": UUIDS,
         "message": obj({"role": st.just("assistant"), "content": st.lists(CC_BLOCK, max_size=2)},
                        {"id": st.sampled_from(["m1", "m2", "m3"]), "model": NAMES,
                         "usage": CC_USAGE, "stop_reason": st.sampled_from(["tool_use", None])})},
        {"parentUuid": st.none() | UUIDS, "requestId": TEXT}),
    obj({"type": st.just("user"), "uuid": UUIDS,
         "message": obj({"role": st.just("user"),
                         "content": TEXT | st.lists(CC_RESULT | PART, max_size=2)})},
        {"parentUuid": st.none() | UUIDS, "toolUseResult": JSON, "isSidechain": st.booleans(),
         "agentId": st.sampled_from(["a1", "a2"])}),
    obj({"type": st.sampled_from(["summary", "progress", "system", "file-history-snapshot"])},
        {"uuid": UUIDS, "parentUuid": UUIDS, "data": JSON}),
)
CLAUDE_CODE = hostile(st.lists(CC_LINE, min_size=1, max_size=8))

RESPONSES_PART = obj({"type": st.sampled_from(["input_text", "output_text"]), "text": TEXT})
CODEX_ITEM = st.one_of(
    obj({"type": st.just("message"),
         "role": st.sampled_from(["user", "assistant", "developer", "robot"]),
         "content": st.lists(RESPONSES_PART, max_size=2)}, {"phase": TEXT}),
    obj({"type": st.just("reasoning"),
         "summary": st.lists(obj({"type": st.just("summary_text"), "text": TEXT}), max_size=2)},
        {"content": st.none(), "encrypted_content": TEXT}),
    obj({"type": st.just("function_call"), "name": NAMES, "call_id": IDS,
         "arguments": ARGUMENTS}),
    obj({"type": st.just("custom_tool_call"), "name": NAMES, "call_id": IDS, "input": TEXT}),
    obj({"type": st.sampled_from(["function_call_output", "custom_tool_call_output"]),
         "call_id": IDS, "output": TEXT | st.lists(RESPONSES_PART, max_size=2)}),
)
CODEX_USAGE = obj({"input_tokens": st.integers(0, 99), "output_tokens": st.integers(0, 9)},
                  {"cached_input_tokens": st.integers(0, 99)})
CODEX_LINE = obj(
    {"type": st.sampled_from(["response_item"] * 6 + ["event_msg", "event_msg", "turn_context",
                                                      "session_meta", "compacted"]),
     "payload": st.one_of(CODEX_ITEM, CODEX_ITEM, CODEX_ITEM,
                          obj({"type": st.just("token_count"),
                               "info": st.none() | obj({}, {"last_token_usage": CODEX_USAGE,
                                                           "total_token_usage": CODEX_USAGE})}),
                          obj({}, {"model": TEXT, "base_instructions": obj({"text": TEXT}),
                                   "message": TEXT,
                                   "replacement_history": st.lists(CODEX_ITEM, max_size=2)}))},
    {"timestamp": TEXT})
CODEX = hostile(st.lists(CODEX_LINE, min_size=1, max_size=8))

# -- the property -----------------------------------------------------------------


def _row_counts(store) -> tuple[int, ...]:
    with store.engine.connect() as conn:
        return tuple(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()
                     for table in ("blobs", "steps", "refs", "reflog", "notes"))


def _steps(store, run: str) -> list[tuple[Any, ...]]:
    """What a round trip must give back, step by step."""
    return [(s.kind, s.content, s.meta.get("model"), s.meta.get("tool"),
             s.meta.get("call_id"), s.meta.get("error")) for s in store.path(run)]


def _as_file(document: Any, fmt: str) -> io.BytesIO:
    """The document as a file's bytes (NaN written as NaN, a lone surrogate escaped); a log's
    lines one a line."""
    if fmt in ("claude-code", "codex") and isinstance(document, list):
        return io.BytesIO("".join(json.dumps(line) + "\n" for line in document).encode("utf-8"))
    return io.BytesIO(json.dumps(document).encode("utf-8"))


def imports_back_or_is_refused(store, document: Any, fmt: str) -> str:
    run = f"p{next(_RUNS)}"
    note(f"document: {json.dumps(document)}")
    before = _row_counts(store)
    try:
        import_file(store, _as_file(document, fmt), format=fmt, run=run)
    except UsageError as exc:
        event("refused: " + re.sub(r"\[\d+\]", "[i]", str(exc))[:48])
        assert "\n" not in str(exc)
        assert _row_counts(store) == before
        return "refused"
    event("imported")
    exported = io.BytesIO()
    export_file(store, run, exported, format=fmt, include_content=fmt == "otel")
    exported.seek(0)
    import_file(store, exported, format=fmt, run=f"{run}-again")
    assert _steps(store, f"{run}-again") == _steps(store, run)
    return "imported"


@SETTINGS
@given(document=OPENAI)
def test_an_openai_document_imports_back_or_is_refused(store, document):
    assert imports_back_or_is_refused(store, document, "openai") in ("imported", "refused")


@SETTINGS
@given(document=ATIF)
def test_an_atif_document_imports_back_or_is_refused(store, document):
    assert imports_back_or_is_refused(store, document, "atif") in ("imported", "refused")


@SETTINGS
@given(document=OTEL)
def test_an_otel_document_imports_back_or_is_refused(store, document):
    assert imports_back_or_is_refused(store, document, "otel") in ("imported", "refused")


@SETTINGS
@given(document=CLAUDE_CODE)
def test_a_claude_code_transcript_imports_back_or_is_refused(store, document):
    assert imports_back_or_is_refused(store, document, "claude-code") in ("imported", "refused")


@SETTINGS
@given(document=CODEX)
def test_a_codex_rollout_imports_back_or_is_refused(store, document):
    assert imports_back_or_is_refused(store, document, "codex") in ("imported", "refused")
