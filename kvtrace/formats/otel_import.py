"""OpenTelemetry traces in: the GenAI spans of one OTLP-JSON trace as a run's steps.

The inverse of otel.py's export, for traces kvtrace wrote with
`--include-content` and for other GenAI instrumentations that record
content: every span whose `gen_ai.operation.name` is `chat` becomes a
model_call (messages from `gen_ai.system_instructions` and
`gen_ai.input.messages`, the response from `gen_ai.output.messages`, tools,
usage, request parameters, the span's duration as `timings.total_s`), every
`execute_tool` span a tool_call (name, call id, arguments, result, an ERROR
status as its error). Spans of other operations are left out; steps follow
the order in which the spans ended. Attributes kvtrace does not map are
kept in `meta.extra.otel`. A chat span without its messages cannot become a
step: the error says to export with content. One document is one trace, and
its spans a tree: a span id used twice, or a span its own ancestor, is
refused.
"""

from __future__ import annotations

import json
from typing import Any

from kvtrace.apis.chat import normalize_message, normalize_response
from kvtrace.errors import UsageError
from kvtrace.formats.otel import REQUEST_PARAMS
from kvtrace.formats.records import (
    UNKNOWN_MODEL,
    ModelCallRecord,
    Record,
    ToolCallRecord,
    check_storable,
    record,
)
from kvtrace.rendering import content_text
from kvtrace.store import OnStep, RunInfo, Store

_MAPPED = frozenset({
    "gen_ai.operation.name", "gen_ai.request.model", "gen_ai.response.model",
    "gen_ai.response.finish_reasons", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
    "gen_ai.usage.cache_read.input_tokens", "gen_ai.usage.cache_creation.input_tokens",
    "gen_ai.input.messages", "gen_ai.output.messages",
    "gen_ai.system_instructions", "gen_ai.tool.definitions", "gen_ai.tool.name",
    "gen_ai.tool.call.id", "gen_ai.tool.call.arguments", "gen_ai.tool.call.result",
    *REQUEST_PARAMS.values(),
})


def import_otel(store: Store, document: Any, *, run: str,
                on_step: OnStep | None = None) -> RunInfo:
    """Record the GenAI spans of one OTLP-JSON trace as the new run `run`."""
    return record(store, run, otel_records(document), on_step=on_step)


def otel_records(document: Any) -> list[Record]:
    """The steps a trace becomes: its chat and execute_tool spans, in the order they ended.

    Chat spans need their content (`gen_ai.input.messages` and
    `gen_ai.output.messages`: an export with --include-content); spans of
    other operations are left out. Attributes kvtrace does not map are kept
    in `meta.extra.otel`.
    """
    check_storable(document)
    spans = _spans(document)
    records: list[Record] = []
    for where, span in spans:
        attributes = _decoded(span.get("attributes", []), where)
        operation = attributes.get("gen_ai.operation.name")
        if operation == "chat":
            records.append(_model_call(span, attributes, where))
        elif operation == "execute_tool":
            records.append(_tool_call(span, attributes, where))
    if not records:
        raise UsageError("the trace has no span with gen_ai.operation.name chat or execute_tool")
    return records


def _spans(document: Any) -> list[tuple[str, dict[str, Any]]]:
    """(where, span) of every span of the document's one trace, in the order they ended."""
    if not isinstance(document, dict) or not isinstance(document.get("resourceSpans"), list):
        raise UsageError("an OTLP-JSON document is an object with resourceSpans "
                         "(an ExportTraceServiceRequest)")
    found = []
    for r, resource in enumerate(document["resourceSpans"]):
        scopes = resource.get("scopeSpans") if isinstance(resource, dict) else None
        if not isinstance(scopes, list):
            raise UsageError(f"resourceSpans[{r}].scopeSpans must be a list")
        for c, scope in enumerate(scopes):
            spans = scope.get("spans") if isinstance(scope, dict) else None
            if not isinstance(spans, list):
                raise UsageError(f"resourceSpans[{r}].scopeSpans[{c}].spans must be a list")
            for n, span in enumerate(spans):
                where = f"resourceSpans[{r}].scopeSpans[{c}].spans[{n}]"
                if not isinstance(span, dict) or not isinstance(span.get("name"), str):
                    raise UsageError(f"{where} must be a span with a name")
                for key in ("startTimeUnixNano", "endTimeUnixNano"):
                    _nanos(span.get(key, "0"), f"{where}.{key}")
                for key in ("traceId", "spanId", "parentSpanId"):
                    if not isinstance(span.get(key, ""), str):
                        raise UsageError(f"{where}.{key} must be hex text")
                found.append((where, span))
    traces = {span.get("traceId") for _, span in found}
    if len(traces) > 1:
        raise UsageError(f"the document holds {len(traces)} traces: a run is one trace, "
                         "import them one by one")
    _check_tree(found)
    return sorted(found, key=lambda item: (_nanos(item[1].get("endTimeUnixNano", "0"), ""),
                                           _nanos(item[1].get("startTimeUnixNano", "0"), "")))


def _check_tree(found: list[tuple[str, dict[str, Any]]]) -> None:
    """The spans form a tree: each span id once, no span its own ancestor.

    A parent outside the document is allowed (a trace exported in part).
    """
    where_of: dict[str, str] = {}
    parent_of: dict[str, str] = {}
    for where, span in found:
        span_id, parent = span.get("spanId") or None, span.get("parentSpanId") or None
        if span_id is None:
            continue
        if span_id in where_of:
            raise UsageError(f"{where}: spanId {span_id!r} is used twice (also by "
                             f"{where_of[span_id]}): a trace holds each span once")
        if parent == span_id:
            raise UsageError(f"{where}: parentSpanId is its own spanId {span_id!r}")
        where_of[span_id] = where
        if parent is not None:
            parent_of[span_id] = parent
    is_rooted: set[str] = set()  # spans whose ancestors are known to end
    for start in parent_of:
        chain: set[str] = set()
        current: str | None = start
        while current is not None and current not in is_rooted:
            if current in chain:
                raise UsageError(f"{where_of[current]}: its parentSpanId leads back to itself "
                                 "(a cycle): a trace's spans form a tree")
            chain.add(current)
            current = parent_of.get(current)
        is_rooted.update(chain)


def _nanos(value: Any, where: str) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{where} must be nanoseconds (a decimal string)") from None


def _seconds(span: dict[str, Any]) -> float | None:
    start = _nanos(span.get("startTimeUnixNano", "0"), "")
    end = _nanos(span.get("endTimeUnixNano", "0"), "")
    return round((end - start) / 1e9, 6) if end > start else None


def _decoded(attributes: Any, where: str) -> dict[str, Any]:
    if not isinstance(attributes, list):
        raise UsageError(f"{where}.attributes must be a list")
    out = {}
    for index, item in enumerate(attributes):
        if not isinstance(item, dict) or not isinstance(item.get("key"), str):
            raise UsageError(f"{where}.attributes[{index}] must be a key and a value")
        out[item["key"]] = plain_value(item.get("value"), f"{where}.attributes[{index}]")
    return out


def plain_value(value: Any, where: str = "value") -> Any:
    """An OTLP AnyValue in JSON as a Python value (the inverse of `any_value`)."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict) or len(value) != 1:
        raise UsageError(f"{where} must be an AnyValue with one field")
    (kind, item), = value.items()
    if kind in ("stringValue", "boolValue", "bytesValue"):
        return item
    if kind == "intValue":
        return _nanos(item, where)
    if kind == "doubleValue":
        return float(item)
    if kind in ("arrayValue", "kvlistValue") and isinstance(item, dict):
        values = item.get("values", [])
        if kind == "arrayValue" and isinstance(values, list):
            return [plain_value(v, f"{where}[{i}]") for i, v in enumerate(values)]
        if isinstance(values, list) and all(isinstance(v, dict) for v in values):
            return {str(v.get("key")): plain_value(v.get("value"), f"{where}.{v.get('key')}")
                    for v in values}
    raise UsageError(f"{where}: {kind} is not an OTLP AnyValue")


def _model_call(span: dict[str, Any], attributes: dict[str, Any], where: str) -> ModelCallRecord:
    inputs, outputs = attributes.get("gen_ai.input.messages"), attributes.get(
        "gen_ai.output.messages")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not outputs:
        raise UsageError(f"{where} ({span['name']}) has no gen_ai.input.messages and "
                         "gen_ai.output.messages: export the trace with its content "
                         "(include_content=True; kvtrace export --include-content)")
    system = attributes.get("gen_ai.system_instructions") or []
    messages = [normalize_message({"role": "system", "content": _part_text(part)},
                                  f"{where} gen_ai.system_instructions")
                for part in (system if isinstance(system, list) else [system])]
    messages += [_message_of(m, f"{where} gen_ai.input.messages[{i}]")
                 for i, m in enumerate(inputs)]
    response = normalize_response(_message_of(outputs[0], f"{where} gen_ai.output.messages[0]"))
    model = (attributes.get("gen_ai.request.model") or attributes.get("gen_ai.response.model")
             or span["name"].removeprefix("chat ").strip() or UNKNOWN_MODEL)
    reasons = attributes.get("gen_ai.response.finish_reasons")
    usage = {
        "prompt_tokens": attributes.get("gen_ai.usage.input_tokens"),
        "completion_tokens": attributes.get("gen_ai.usage.output_tokens"),
        "cached_tokens": attributes.get("gen_ai.usage.cache_read.input_tokens"),
        "cache_creation_input_tokens": attributes.get("gen_ai.usage.cache_creation.input_tokens"),
        "finish_reason": reasons[0] if isinstance(reasons, list) and reasons else None,
    }
    params = {key: attributes[attribute] for key, attribute in REQUEST_PARAMS.items()
              if key in ("temperature", "top_p", "top_k", "max_tokens", "seed",
                         "frequency_penalty", "presence_penalty", "stop")
              and attributes.get(attribute) is not None}
    tools = attributes.get("gen_ai.tool.definitions")
    seconds = _seconds(span)
    return ModelCallRecord(messages, response, str(model),
                           tools if isinstance(tools, list) and tools else None,
                           {k: v for k, v in usage.items() if v is not None} or None,
                           _kept(span, attributes), params or None,
                           {"total_s": seconds} if seconds else None)


def _tool_call(span: dict[str, Any], attributes: dict[str, Any], where: str) -> ToolCallRecord:
    name = attributes.get("gen_ai.tool.name") or span["name"].removeprefix("execute_tool ")
    status = span.get("status")
    is_error = isinstance(status, dict) and status.get("code") in (2, "STATUS_CODE_ERROR")
    error = (str(status.get("message") or attributes.get("error.type") or "error")
             if isinstance(status, dict) and is_error else None)
    call_id = attributes.get("gen_ai.tool.call.id")
    seconds = _seconds(span)
    return ToolCallRecord(str(name).strip() or "unknown",
                          attributes.get("gen_ai.tool.call.arguments"),
                          attributes.get("gen_ai.tool.call.result"),
                          call_id if isinstance(call_id, str) else None, error,
                          {"duration_s": seconds} if seconds else None)


def _part_text(part: Any) -> str:
    """The text of a conventions part ({"type": "text", "content": ...}) or of plain text."""
    return content_text(part.get("content")) if isinstance(part, dict) else content_text(part)


def _message_of(message: Any, where: str) -> dict[str, Any]:
    """A conventions-shaped message (role and parts) as an OpenAI chat message."""
    if not isinstance(message, dict) or not isinstance(message.get("parts"), list):
        raise UsageError(f"{where} must be a message with role and parts")
    role = message.get("role")
    out: dict[str, Any] = {"role": role}
    texts: list[dict[str, Any]] = []
    calls = []
    for index, part in enumerate(message["parts"]):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise UsageError(f"{where}.parts[{index}] must be a part with a type")
        if kind == "text":
            texts.append({"type": "text", "text": _part_text(part)})
        elif kind == "reasoning":
            out["reasoning_content"] = _part_text(part)
        elif kind == "tool_call":
            arguments = part.get("arguments")
            calls.append({"id": part.get("id"), "type": "function", "function": {
                "name": part.get("name"),
                "arguments": arguments if isinstance(arguments, str) else json.dumps(
                    {} if arguments is None else arguments, ensure_ascii=False)}})
        elif kind == "tool_call_response":
            out["role"], out["tool_call_id"] = "tool", part.get("id")
            response = part.get("response", part.get("result"))
            if response is not None:  # a structured result is given to the model as JSON text
                texts.append({"type": "text", "text": response if isinstance(response, str)
                              else json.dumps(response, ensure_ascii=False)})
        else:
            texts.append(dict(part))  # images, files...: kept as content parts
    if all(part.get("type") == "text" for part in texts):
        out["content"] = "".join(part["text"] for part in texts) if texts else None
    else:
        out["content"] = texts
    if calls:
        out["tool_calls"] = calls
    return normalize_message(out, where)


def _kept(span: dict[str, Any], attributes: dict[str, Any]) -> dict[str, Any]:
    """What the run keeps of a span beyond the mapped attributes (meta.extra.otel)."""
    unmapped = {key: value for key, value in attributes.items()
                if key not in _MAPPED and not key.startswith("kvtrace.")}
    kept: dict[str, Any] = {"span": span["name"]}
    if unmapped:
        kept["attributes"] = unmapped
    return {"otel": kept}
