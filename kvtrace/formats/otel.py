"""OpenTelemetry traces: a run as OTLP-JSON spans with the GenAI semantic conventions.

`export_otel(store, spec)` gives an `ExportTraceServiceRequest` in the OTLP
JSON encoding (resourceSpans → scopeSpans → spans): one trace per run, one
span per step, each span the child of its parent step's span, so the span
tree is the step chain. Ids are derived, never random: the trace id is the
first 16 bytes of SHA-256 over the run's name and root step id (exporting a
run again, even after it grew, gives the same trace), a span id the first 8
bytes over the trace id and the step id. Both are hex, as OTLP-JSON wants
(not the base64 of protobuf's own JSON mapping); enums are integers and
64-bit integers decimal strings.

- model_call → span `chat {model}` (kind CLIENT): `gen_ai.operation.name`
  chat, `gen_ai.provider.name` (recorded `extra.provider`; "kvtrace" when
  kvtrace's engine answered; else guessed from the recorded URL or model
  name; else "unknown"), `server.address` and `server.port` of the recorded
  URL, `gen_ai.request.model`,
  `gen_ai.response.finish_reasons` (recorded, else derived: tool_calls or
  stop), `gen_ai.usage.input_tokens` (everything the model read, cache
  reads and writes included, as the conventions ask: `Usage.prompt_tokens`,
  so Anthropic's `input_tokens` + both cache counts), `gen_ai.usage.output_tokens`,
  `gen_ai.usage.cache_read.input_tokens` and
  `gen_ai.usage.cache_creation.input_tokens` (each only when the provider
  reported it: unknown is never 0), `gen_ai.conversation.id` (the run), sampling
  parameters as `gen_ai.request.*`, `gen_ai.response.id`.
- tool_call → span `execute_tool {tool}` (kind INTERNAL): `gen_ai.tool.name`,
  `gen_ai.tool.call.id`, `gen_ai.tool.type` function; an error sets the
  span status to ERROR and `error.type`.
- any other kind → span named by the kind (INTERNAL).

Content stays out unless `include_content` is set (the conventions make it
opt-in: it may hold secrets or personal data): then tool spans carry
`gen_ai.tool.call.arguments` and `gen_ai.tool.call.result`, and chat spans
`gen_ai.input.messages`, `gen_ai.output.messages`, `gen_ai.system_instructions`
and `gen_ai.tool.definitions`, as structured values. A span ends at the
step's `recorded_at` and starts its recorded duration earlier (`timings`
`total_s`, `duration_s`, or `prefill_s` + `decode_s`; zero when unknown).
Every span also has `kvtrace.step.id` and `kvtrace.step.depth`.

Import (the other way, otel_import.py) reads such a trace back.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from importlib import metadata
from typing import Any
from urllib.parse import urlsplit

from kvtrace.apis.chat import tool_calls_of
from kvtrace.errors import UsageError
from kvtrace.rendering import content_text
from kvtrace.store import OnStep, Step, Store
from kvtrace.store.kinds import ModelCall, ToolCall, view

SPAN_KIND_INTERNAL = 1
SPAN_KIND_CLIENT = 3
STATUS_CODE_ERROR = 2
SCOPE = "kvtrace"

# Host names and model-name prefixes of the providers the conventions name (well-known values).
_PROVIDER_HOSTS = {
    "api.openai.com": "openai", "api.anthropic.com": "anthropic",
    "generativelanguage.googleapis.com": "gcp.gemini", "aiplatform.googleapis.com":
    "gcp.vertex_ai", "api.mistral.ai": "mistral_ai", "api.groq.com": "groq",
    "api.deepseek.com": "deepseek", "api.x.ai": "x_ai", "api.perplexity.ai": "perplexity",
    "api.cohere.com": "cohere",
}
_PROVIDER_MODELS = (
    ("gpt-", "openai"), ("o1", "openai"), ("o3", "openai"), ("o4", "openai"),
    ("claude", "anthropic"), ("gemini", "gcp.gen_ai"), ("mistral", "mistral_ai"),
    ("deepseek", "deepseek"), ("grok", "x_ai"), ("command", "cohere"),
)
REQUEST_PARAMS = {
    "temperature": "gen_ai.request.temperature", "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k", "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "max_new_tokens": "gen_ai.request.max_tokens", "seed": "gen_ai.request.seed",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "stop": "gen_ai.request.stop_sequences",
}
_DOUBLES = frozenset({"gen_ai.request.temperature", "gen_ai.request.top_p",
                      "gen_ai.request.top_k", "gen_ai.request.frequency_penalty",
                      "gen_ai.request.presence_penalty"})


def export_otel(store: Store, spec: str, *, include_content: bool = False,
                on_step: OnStep | None = None) -> dict[str, Any]:
    """The run up to `spec` as an OTLP-JSON ExportTraceServiceRequest (see the module docstring)."""
    path = list(store.walk(spec, on_step=on_step))
    if not path:
        raise UsageError(f"{spec} has no steps: there is nothing to export")
    run = _run_name(store, spec, path[-1])
    trace = trace_id(run, path[0].id)
    spans = []
    for step in path:
        parent = span_id(trace, step.parent_id) if step.parent_id else ""
        spans.append(_span(step, trace, parent, run, include_content))
    return {"resourceSpans": [{
        "resource": {"attributes": _attributes({
            "service.name": "kvtrace", "kvtrace.run": run, "kvtrace.head": path[-1].id,
        })},
        "scopeSpans": [{"scope": {"name": SCOPE, "version": _version()}, "spans": spans}],
    }]}


def trace_id(run: str, root_id: str) -> str:
    """The run's trace id: 16 bytes, hex, from its name and root step."""
    return _derived(f"kvtrace/otel/trace\0{run}\0{root_id}", 16)


def span_id(trace: str, step_id: str) -> str:
    """A step's span id in the trace `trace`: 8 bytes, hex."""
    return _derived(f"kvtrace/otel/span\0{trace}\0{step_id}", 8)


def _derived(text: str, size: int) -> str:
    digest = bytearray(hashlib.sha256(text.encode("utf-8")).digest()[:size])
    if not any(digest):  # an all-zero id is invalid in OTLP
        digest[-1] = 1
    return digest.hex()


def _run_name(store: Store, spec: str, head: Step) -> str:
    """The run that `spec` names (RUN, RUN@N, RUN~K), else the head step's id."""
    name = spec.split("@", 1)[0].split("~", 1)[0]
    return name if store.has_run(name) else head.id


def _span(step: Step, trace: str, parent: str, run: str, include_content: bool) -> dict[str, Any]:
    end = round(step.recorded_at * 1e9)
    typed = view(step)
    start = end - round(_duration_s(typed.timings if typed else None) * 1e9)
    attributes: dict[str, Any] = {}
    status: dict[str, Any] = {}
    kind = SPAN_KIND_INTERNAL
    if isinstance(typed, ModelCall):
        name, kind = f"chat {typed.model or 'unknown'}", SPAN_KIND_CLIENT
        attributes = _chat_attributes(typed, run, include_content)
    elif isinstance(typed, ToolCall):
        name = f"execute_tool {typed.tool}"
        attributes = {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": typed.tool,
            "gen_ai.tool.call.id": typed.call_id, "gen_ai.tool.type": "function",
            "gen_ai.conversation.id": run,
        }
        if include_content:
            # As recorded: JSON text decoded here would come back as a value, not text.
            attributes["gen_ai.tool.call.arguments"] = typed.arguments
            attributes["gen_ai.tool.call.result"] = typed.result
        error = typed.error
        if error:
            attributes["error.type"] = "tool_error"
            status = {"code": STATUS_CODE_ERROR, "message": str(error)}
    else:
        name = step.kind
    attributes.update({"kvtrace.step.id": step.id, "kvtrace.step.kind": step.kind,
                       "kvtrace.step.depth": step.depth})
    span: dict[str, Any] = {
        "traceId": trace, "spanId": span_id(trace, step.id), "parentSpanId": parent,
        "name": name, "kind": kind, "startTimeUnixNano": str(max(0, start)),
        "endTimeUnixNano": str(end), "attributes": _attributes(attributes),
    }
    if status:
        span["status"] = status
    return span


def _chat_attributes(call: ModelCall, run: str, include_content: bool) -> dict[str, Any]:
    params, extra, usage = call.params, call.extra, call.usage
    response = call.response
    recorded = _mapping(extra.get("response"))
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": _provider(call),
        "gen_ai.request.model": call.request_model,
        "gen_ai.response.model": call.model,
        "gen_ai.response.id": recorded.get("id"),
        "gen_ai.response.finish_reasons": [_finish_reason(usage.finish_reason, response)],
        "gen_ai.usage.input_tokens": usage.prompt_tokens,  # cache reads and writes included
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cached_tokens,
        "gen_ai.usage.cache_creation.input_tokens": usage.cache_write_tokens,
        "gen_ai.conversation.id": run,
    }
    host, port = _server(extra)
    if host:
        attributes.update({"server.address": host, "server.port": port})
    for key, attribute in REQUEST_PARAMS.items():
        value = params.get(key)
        if key == "stop" and isinstance(value, str):
            value = [value]
        elif attribute in _DOUBLES and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # the conventions type these as double: 0 is 0.0
        if attributes.get(attribute) is None:
            attributes[attribute] = value
    if include_content:
        messages = call.messages
        leading = 0  # the system prompt: system messages of text before any other message
        while leading < len(messages) and messages[leading].get("role") == "system" and (
                isinstance(messages[leading].get("content"), str)):
            leading += 1
        attributes["gen_ai.system_instructions"] = [
            {"type": "text", "content": m["content"]} for m in messages[:leading]] or None
        attributes["gen_ai.input.messages"] = [_message(m) for m in messages[leading:]]
        output = _message(response) if isinstance(response, Mapping) else None
        if output is not None:
            output["finish_reason"] = attributes["gen_ai.response.finish_reasons"][0]
        attributes["gen_ai.output.messages"] = [output] if output else None
        attributes["gen_ai.tool.definitions"] = call.tools
    return attributes


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message in the conventions' shape: role and parts (text, tool_call, response).

    Written so that otel_import reads the same message back: a null content
    is no part; a tool result's text is its `response`, its content parts
    (images, ...) follow it; content parts go one by one, text as text.
    """
    parts: list[dict[str, Any]] = []
    role = str(message.get("role", "user"))
    if message.get("reasoning_content") is not None:
        parts.append({"type": "reasoning", "content": message["reasoning_content"]})
    content = message.get("content")
    if role == "tool":
        answer = {"type": "tool_call_response", "id": message.get("tool_call_id")}
        parts.append({**answer, "response": content} if isinstance(content, str) else answer)
    if isinstance(content, list):
        parts += [{"type": "text", "content": content_text([part])}
                  if isinstance(part, Mapping) and part.get("type") == "text" else dict(part)
                  for part in content]
    elif content is not None and role != "tool":
        parts.append({"type": "text", "content": content_text(content)})
    for call in tool_calls_of(message):
        function = call.get("function") or {}
        parts.append({"type": "tool_call", "id": call.get("id"), "name": function.get("name"),
                      "arguments": _parsed(function.get("arguments"))})
    return {"role": role, "parts": parts}


def _provider(call: ModelCall) -> str:
    extra = call.extra
    if isinstance(extra.get("provider"), str) and extra["provider"]:
        return str(extra["provider"])
    served_by = extra.get("served_by")
    if (isinstance(served_by, str) and served_by.startswith("kvtrace")) or (
            call.output_ids is not None):
        return "kvtrace"  # kvtrace's own engine answered (serve local, continue, branch)
    host = _server(extra)[0]
    if host in _PROVIDER_HOSTS:
        return _PROVIDER_HOSTS[host]
    if host and host.endswith(".openai.azure.com"):
        return "azure.ai.openai"
    model = (call.model or "").lower().rsplit("/", 1)[-1]
    return next((name for prefix, name in _PROVIDER_MODELS if model.startswith(prefix)),
                "unknown")


def _server(extra: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """(host, port) of the recorded request's URL, when the tracer recorded one."""
    http = extra.get("http")
    if not isinstance(http, Mapping) or not isinstance(http.get("url"), str):
        return None, None
    try:
        parts = urlsplit(http["url"])
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:  # a malformed URL names no server
        return None, None
    return parts.hostname, port


def _finish_reason(recorded: str | None, response: Any) -> str:
    if recorded:
        return recorded
    return "tool_calls" if tool_calls_of(response) else "stop"


def _duration_s(timings: Any) -> float:
    if not isinstance(timings, Mapping):
        return 0.0
    for key in ("total_s", "duration_s"):
        if isinstance(timings.get(key), (int, float)):
            return max(0.0, float(timings[key]))
    parts = [timings.get(k) for k in ("prefill_s", "decode_s")]
    return max(0.0, sum(float(p) for p in parts if isinstance(p, (int, float))))


def _parsed(arguments: Any) -> Any:
    """A tool call's arguments, structured as the conventions ask, when import gives them
    back: JSON text that `json.dumps` writes the same (else, and for a string, text)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        value = json.loads(arguments, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return arguments
    if value is None or isinstance(value, str) or (
            json.dumps(value, ensure_ascii=False) != arguments):
        return arguments
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _attributes(values: Mapping[str, Any]) -> list[dict[str, Any]]:
    """OTLP KeyValue list; None values are left out (unknown, not recorded)."""
    return [{"key": key, "value": any_value(value)} for key, value in values.items()
            if value is not None]


def any_value(value: Any) -> dict[str, Any]:
    """An OTLP AnyValue in JSON: strings, booleans, ints (decimal strings), doubles, lists, maps."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bytes):
        return {"stringValue": value.decode("utf-8", errors="replace")}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [any_value(item) for item in value]}}
    if isinstance(value, Mapping):
        return {"kvlistValue": {"values": [
            {"key": str(key), "value": any_value(item)} for key, item in value.items()]}}
    if value is None:
        return {}
    return {"stringValue": str(value)}


def _version() -> str:
    try:
        return metadata.version("kvtrace")
    except metadata.PackageNotFoundError:
        return "0"
