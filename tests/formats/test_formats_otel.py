"""OTel export: a run as OTLP-JSON spans (GenAI conventions), parsed by opentelemetry-proto."""

from __future__ import annotations

import base64
import copy
import io
import json

import pytest
from google.protobuf.json_format import Parse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvtrace.cli import main
from kvtrace.errors import UsageError
from kvtrace.formats import export_document, export_file, import_document, import_otel
from kvtrace.formats.otel import any_value, span_id, trace_id
from kvtrace.store import kinds
from kvtrace.store.present.compare import compare
from tests.agent_runs import record_calc_run
from tests.formats.conftest import state

SPAN_KIND_CLIENT, SPAN_KIND_INTERNAL = 3, 1


def parse_otlp(document) -> ExportTraceServiceRequest:
    """Parse OTLP-JSON as a collector does: ids are hex there, base64 in protobuf's JSON mapping."""
    converted = copy.deepcopy(document)
    for resource in converted["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return Parse(json.dumps(converted), ExportTraceServiceRequest())


def attributes(span) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(item) for item in v.array_value.values]
        if kind == "kvlist_value":
            return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
        return getattr(v, kind) if kind else None

    return {kv.key: value(kv.value) for kv in span.attributes}


@pytest.fixture
def calc_store(store):
    record_calc_run(store.run("main"))
    store.run("main").record_tool_call("calc", {"expr": "1/0"}, None, error="ZeroDivisionError")
    return store


def test_the_file_parses_as_an_otlp_export_trace_service_request(calc_store):
    buffer = io.BytesIO()
    export_file(calc_store, "main", buffer, format="otel")
    text = buffer.getvalue().decode()
    Parse(text, ExportTraceServiceRequest())  # the file as written, through protobuf's parser
    request = parse_otlp(json.loads(text))
    spans = request.resource_spans[0].scope_spans[0].spans
    assert len(spans) == 4  # one span per step
    assert {len(s.trace_id) for s in spans} == {16} and {len(s.span_id) for s in spans} == {8}


def test_spans_form_one_trace_whose_tree_is_the_step_chain(calc_store):
    request = parse_otlp(export_document(calc_store, "main", format="otel"))
    spans = request.resource_spans[0].scope_spans[0].spans
    path = calc_store.path("main")
    trace = trace_id("main", path[0].id)
    assert {s.trace_id.hex() for s in spans} == {trace}
    assert [s.span_id.hex() for s in spans] == [span_id(trace, step.id) for step in path]
    assert spans[0].parent_span_id == b""
    assert [s.parent_span_id for s in spans[1:]] == [s.span_id for s in spans[:-1]]
    assert [s.name for s in spans] == ["chat gpt-4o", "execute_tool calc", "chat gpt-4o",
                                       "execute_tool calc"]
    assert [s.kind for s in spans] == [SPAN_KIND_CLIENT, SPAN_KIND_INTERNAL] * 2
    # a span ends when its step was recorded and starts its recorded duration before
    assert spans[0].end_time_unix_nano == round(path[0].recorded_at * 1e9)
    assert spans[0].end_time_unix_nano - spans[0].start_time_unix_nano == 800_000_000


def test_model_calls_carry_the_gen_ai_attributes(calc_store):
    request = parse_otlp(export_document(calc_store, "main", format="otel"))
    first, _, answer, _ = request.resource_spans[0].scope_spans[0].spans
    found = attributes(answer)
    assert found["gen_ai.operation.name"] == "chat"
    assert found["gen_ai.provider.name"] == "openai"  # from the model name, none recorded
    assert found["gen_ai.request.model"] == "gpt-4o"
    assert found["gen_ai.response.finish_reasons"] == ["stop"]
    assert found["gen_ai.usage.input_tokens"] == 80
    assert found["gen_ai.usage.output_tokens"] == 7
    assert found["gen_ai.usage.cache_read.input_tokens"] == 64
    assert found["gen_ai.conversation.id"] == "main"
    assert attributes(first)["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert "gen_ai.input.messages" not in found  # content is opt-in


def test_tool_calls_carry_name_and_call_id_and_content_only_when_asked(calc_store):
    plain = parse_otlp(export_document(calc_store, "main", format="otel"))
    tool = attributes(plain.resource_spans[0].scope_spans[0].spans[1])
    assert tool["gen_ai.operation.name"] == "execute_tool"
    assert tool["gen_ai.tool.name"] == "calc" and tool["gen_ai.tool.call.id"] == "call_1"
    assert "gen_ai.tool.call.arguments" not in tool and "gen_ai.tool.call.result" not in tool

    full = parse_otlp(export_document(calc_store, "main", format="otel", include_content=True))
    spans = full.resource_spans[0].scope_spans[0].spans
    tool = attributes(spans[1])
    assert tool["gen_ai.tool.call.arguments"] == {"expr": "17 * 23"}
    assert tool["gen_ai.tool.call.result"] == "391"
    chat = attributes(spans[2])
    assert chat["gen_ai.system_instructions"] == [
        {"type": "text", "content": "You are a careful calculator."}]
    asked, answered = chat["gen_ai.input.messages"][1], chat["gen_ai.input.messages"][2]
    assert asked["parts"][0] == {"type": "tool_call", "id": "call_1", "name": "calc",
                                 "arguments": {"expr": "17 * 23"}}
    assert answered == {"role": "tool", "parts": [
        {"type": "tool_call_response", "id": "call_1", "response": "391"}]}
    assert chat["gen_ai.output.messages"][0]["parts"] == [
        {"type": "text", "content": "The answer is 391."}]


def test_a_failed_tool_call_is_an_error_span(calc_store):
    request = parse_otlp(export_document(calc_store, "main", format="otel"))
    failed = request.resource_spans[0].scope_spans[0].spans[3]
    assert failed.status.code == 2 and failed.status.message == "ZeroDivisionError"
    assert attributes(failed)["error.type"] == "tool_error"


def test_exporting_again_gives_the_same_ids_and_a_fork_gets_its_own_trace(calc_store):
    first = export_document(calc_store, "main", format="otel")
    assert export_document(calc_store, "main", format="otel") == first
    calc_store.fork("main@2", "fork")
    fork = export_document(calc_store, "fork", format="otel")
    fork_trace = fork["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]
    assert fork_trace != first["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]


def test_a_trace_exported_with_content_imports_back_as_the_same_steps(calc_store):
    document = export_document(calc_store, "main", format="otel", include_content=True)
    import_document(calc_store, json.loads(json.dumps(document)), format="otel", run="back")
    assert compare(calc_store, "main", "back").is_same_content  # every step, field by field
    back = calc_store.path("back")
    assert back[0].meta["usage"] == {"prompt_tokens": 52, "completion_tokens": 9,
                                     "cached_tokens": 0, "finish_reason": "tool_calls"}
    assert back[0].meta["timings"] == {"total_s": 0.8}
    assert back[3].meta["error"] == "ZeroDivisionError"


def test_a_trace_without_content_or_with_two_traces_is_refused_and_writes_nothing(calc_store):
    plain = export_document(calc_store, "main", format="otel")
    with pytest.raises(UsageError, match="--include-content"):
        import_document(calc_store, plain, format="otel", run="back")
    calc_store.fork("main@2", "fork")
    two = export_document(calc_store, "fork", format="otel", include_content=True)
    two["resourceSpans"] += export_document(calc_store, "main", format="otel",
                                            include_content=True)["resourceSpans"]
    with pytest.raises(UsageError, match="2 traces"):
        import_document(calc_store, two, format="otel", run="back")
    assert "back" not in {info.name for info in calc_store.runs()}


def test_cli_export_otel_writes_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    from kvtrace import open_store

    with open_store() as store:
        record_calc_run(store.run("main"))
    out = tmp_path / "main.otel.json"
    for argv, code in ((["export", "main", "--format", "otel", "--include-content", "-o",
                         str(out)], 0),
                       (["export", "main", "--include-content"], 2)):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert (exit_info.value.code or 0) == code
    request = parse_otlp(json.loads(out.read_text()))
    assert len(request.resource_spans[0].scope_spans[0].spans) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: --include-content applies to --format otel only")
    with pytest.raises(SystemExit) as exit_info:
        main(["import", str(out), "--format", "otel", "--run", "back"])
    assert (exit_info.value.code or 0) == 0
    assert capsys.readouterr().out.startswith("imported back (3 steps)")


def test_provider_server_and_request_parameters_come_from_what_was_recorded(store):
    run = store.run("mixed")
    run.record_model_call([{"role": "user", "content": "hi"}], "hello", model="my-model",
                          params={"temperature": 0, "max_tokens": 64, "stop": "END"},
                          extra={"http": {"url": "https://api.anthropic.com/v1/chat/completions"},
                                 "response": {"id": "msg_1"}})
    run.record_model_call([{"role": "user", "content": "hi"}], "hello again", model="SmolLM2",
                          usage={"prompt_tokens": 9, "completion_token_ids": [1, 2]})
    run.record_model_call([{"role": "user", "content": "hi"}], "and again", model="mystery")
    request = parse_otlp(export_document(store, "mixed", format="otel"))
    remote, local, unknown = (attributes(s) for s in request.resource_spans[0].scope_spans[0].spans)
    assert remote["gen_ai.provider.name"] == "anthropic"  # from the URL, not the model name
    assert (remote["server.address"], remote["server.port"]) == ("api.anthropic.com", 443)
    assert remote["gen_ai.response.id"] == "msg_1"
    assert isinstance(remote["gen_ai.request.temperature"], float)  # a double, as typed
    assert remote["gen_ai.request.max_tokens"] == 64
    assert remote["gen_ai.request.stop_sequences"] == ["END"]
    assert local["gen_ai.provider.name"] == "kvtrace"  # kvtrace generated these tokens
    assert unknown["gen_ai.provider.name"] == "unknown"
    assert "gen_ai.usage.cache_read.input_tokens" not in unknown  # not reported: not 0


def _spans(document):
    return document["resourceSpans"][0]["scopeSpans"][0]["spans"]


def _twice(document):
    _spans(document).extend(copy.deepcopy(_spans(document)))


def _own_parent(document):
    first = _spans(document)[0]
    first["parentSpanId"] = first["spanId"]


def _cycle(document):
    spans = _spans(document)
    spans[0]["parentSpanId"] = spans[2]["spanId"]  # 0 <- 1 <- 2 <- 0


SPAN_TREE_CASES = {
    "a span id used twice": (_twice, r"^resourceSpans\[0\]\.scopeSpans\[0\]\.spans\[4\]: spanId "
                                     r"'[0-9a-f]{16}' is used twice \(also by resourceSpans\[0\]"
                                     r"\.scopeSpans\[0\]\.spans\[0\]\)"),
    "a span its own parent": (_own_parent, r"spans\[0\]: parentSpanId is its own spanId"),
    "a cycle of parents": (_cycle, r"spans\[\d\]: its parentSpanId leads back to itself"),
}


@pytest.mark.parametrize("case", sorted(SPAN_TREE_CASES))
def test_spans_that_do_not_form_a_tree_are_refused_and_write_nothing(calc_store, case):
    change, message = SPAN_TREE_CASES[case]
    document = export_document(calc_store, "main", format="otel", include_content=True)
    change(document)
    before = state(calc_store)
    with pytest.raises(UsageError, match=message):
        import_document(calc_store, document, format="otel", run="back")
    assert state(calc_store) == before


def test_a_span_whose_parent_is_outside_the_document_imports(calc_store):
    document = export_document(calc_store, "main", format="otel", include_content=True)
    _spans(document)[0]["parentSpanId"] = "00000000000000aa"  # a trace exported in part
    assert import_document(calc_store, document, format="otel", run="back").depth == 4


def test_span_tree_errors_through_the_cli_are_one_line_exit_2(calc_store, store_url, tmp_path,
                                                              capsys):
    for case, (change, _) in sorted(SPAN_TREE_CASES.items()):
        document = export_document(calc_store, "main", format="otel", include_content=True)
        change(document)
        path = tmp_path / "trace.json"
        path.write_text(json.dumps(document))
        with pytest.raises(SystemExit) as exit_info:
            main(["--store", store_url, "import", str(path), "--format", "otel", "--run", "b"])
        err = capsys.readouterr().err
        assert (exit_info.value.code, err[:7], err.count("\n")) == (2, "error: ", 1), case
    assert "b" not in {info.name for info in calc_store.runs()}


def _attributes_of(values):
    return [{"key": key, "value": any_value(value)} for key, value in values.items()]


def _chat_span(span, inputs, outputs, **more):
    return {"traceId": "t", "spanId": span, "name": "chat m", "endTimeUnixNano": span[-1],
            "attributes": _attributes_of({"gen_ai.operation.name": "chat",
                                          "gen_ai.input.messages": inputs,
                                          "gen_ai.output.messages": outputs, **more})}


def test_a_trace_from_another_instrumentation_exports_and_imports_back_to_the_same_steps(store):
    # Each element once failed the round trip (found by tests/formats/test_import_properties.py).
    image = {"type": "image", "url": "https://example.com/a.png"}
    inputs = [
        {"role": "user", "parts": [{"type": "text", "content": "hi"}, image]},  # parts kept
        {"role": "system", "parts": []},  # a system message with no content, in its place
        {"role": "assistant", "parts": [
            {"type": "reasoning", "content": ""},  # empty reasoning is still reasoning
            {"type": "tool_call", "id": "c1", "name": "f", "arguments": '{"x":1}'}]},  # as text
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1"}]},  # no content
    ]
    outputs = [{"role": "assistant", "parts": [{"type": "text", "content": "done"}]}]
    tool = {"traceId": "t", "spanId": "s1", "name": "execute_tool f", "endTimeUnixNano": "1",
            "attributes": _attributes_of({
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "f",
                "gen_ai.tool.call.id": "c1", "gen_ai.tool.call.arguments": '{"x": 1}',
                "gen_ai.tool.call.result": "[1, 2]"})}  # JSON text stays text
    document = {"resourceSpans": [{"scopeSpans": [{"spans": [
        tool, _chat_span("s2", inputs, outputs)]}]}]}
    import_document(store, document, format="otel", run="other")
    exported = export_document(store, "other", format="otel", include_content=True)
    import_document(store, json.loads(json.dumps(exported)), format="otel", run="back")
    original, back = store.path("other"), store.path("back")
    assert [(s.kind, s.content) for s in back] == [(s.kind, s.content) for s in original]
    assert original[0].content == {"arguments": '{"x": 1}', "result": "[1, 2]"}
    assert [m["role"] for m in original[1].content["messages"]] == [
        "user", "system", "assistant", "tool"]


def test_anthropic_cache_reads_and_writes_are_both_attributes_inside_input_tokens(store):
    usage = {"input_tokens": 3, "cache_read_input_tokens": 15_400,
             "cache_creation_input_tokens": 210, "output_tokens": 57}
    store.run("cc").record_model_call(
        [{"role": "user", "content": "Fix the header."}],
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}],
         "stop_reason": "end_turn"},
        model="claude-sonnet-4-5-20250929", usage=usage, api="anthropic-messages")
    document = export_document(store, "cc", format="otel", include_content=True)
    found = attributes(parse_otlp(document).resource_spans[0].scope_spans[0].spans[0])
    assert found["gen_ai.provider.name"] == "anthropic"
    assert found["gen_ai.usage.input_tokens"] == 3 + 15_400 + 210  # the cached ones included
    assert found["gen_ai.usage.cache_read.input_tokens"] == 15_400
    assert found["gen_ai.usage.cache_creation.input_tokens"] == 210
    assert found["gen_ai.usage.output_tokens"] == 57
    import_otel(store, document, run="back")
    call = kinds.ModelCall(store.path("back")[0])
    assert (call.usage.prompt_tokens, call.usage.cached_tokens, call.usage.cache_write_tokens
            ) == (15_613, 15_400, 210)


def test_a_provider_that_reports_no_cache_write_has_no_such_attribute(calc_store):
    found = attributes(parse_otlp(export_document(calc_store, "main", format="otel"))
                       .resource_spans[0].scope_spans[0].spans[0])
    assert "gen_ai.usage.cache_creation.input_tokens" not in found  # unknown is not 0
