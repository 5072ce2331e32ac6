"""Step kinds and their typed views: the one place that knows a step's meta keys.

A `Step` is generic (kind, content, meta); each kind kvtrace records has a
view here that owns its keys both ways: the writer builds meta with the
view's `meta(...)`, every reader goes through the view's properties. Nothing
else reads `step.meta` by key, so a key is renamed, or a provider API added,
in one module.

- `ModelCall`: the conversation in OpenAI chat shape (`messages`, `tools`,
  `response`: the normalised form that analyze, replay, diff, report and
  export read), the provider API it was spoken in (`api`; absent means
  OpenAI chat completions, so steps recorded before it keep their ids),
  `model`, sampling `params`, the provider's `usage` as sent (read through
  `Usage.parse`), `timings`, and `extra`: what a recorder or importer kept
  (HTTP facts, the requested model name, the response's own ids, fields of
  an imported trajectory kvtrace does not model); a streamed call recorded
  over HTTP may keep its SSE body as the raw field `stream`
  (`recorded_stream`), so a replay sends the same events; a response that
  repeats its settings (Responses) keeps them in `response_settings`, one
  blob shared by the calls whose settings stay the same.
- `ToolCall`: tool name, `arguments`, `result`, `error`, `call_id` (the
  model's tool-call id it answers), and the key order of the result's
  objects where it was not sorted (`returned_result`, keyorder.py).
- `HttpExchange`: method, URL, status, headers, raw bodies, and, for an
  exchange with a model API that could not be read as a model call, why not.
- `NoteStep`: a note recorded as a step of the run (annotations made
  afterwards are `Note` records, not steps).

A step of any other kind is still a `Step`: kinds are open, views are not
required.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from kvtrace.apis import (
    LAYOUTS,
    ChatView,
    ProviderApi,
    chat_response,
    chat_tools,
    chat_view,
    native_request,
    view_messages,
)
from kvtrace.errors import UsageError
from kvtrace.store.objects.lists import shared_prefix
from kvtrace.store.objects.trees import WORKSPACE
from kvtrace.store.records import Step
from kvtrace.store.usage import Usage

# Keys a view writes in `meta` (module-private names on purpose: read through the views).
_MODEL, _PARAMS, _USAGE, _TIMINGS, _EXTRA, _API = (
    "model", "params", "usage", "timings", "extra", "api")
_TOOL, _ERROR, _CALL_ID, _AUTHOR, _TOTAL_S, _COMPLETE, _NOT_MODEL_CALL = (
    "tool", "error", "call_id", "author", "total_s", "complete", "not_model_call")
_KEY_ORDER = "key_order"
_EXIT_CODE, _PASSED, _SECONDS, _TIMED_OUT = "exit_code", "passed", "seconds", "timed_out"
EDIT_OF = "edit_of"  # a step forked with an edit names the step it copies
STREAM_FIELD = "stream"  # a model call's raw field: the SSE body as it arrived
RESPONSE_SETTINGS = "response_settings"  # a model call's payload field (see ModelCall)
TOKEN_IDS_KEY = "completion_token_ids"  # in usage: the exact ids kvtrace generated
MEASUREMENTS = (_USAGE, _TIMINGS)  # what an edited copy drops: they describe the original call


class StepKind(StrEnum):
    """The kinds of step kvtrace itself records (a `str`, so `step.kind == StepKind.X` reads)."""

    MODEL_CALL = "model_call"
    TOOL_CALL = "tool_call"
    HTTP = "http"
    NOTE = "note"
    VERDICT = "verdict"


@dataclass(frozen=True, slots=True)
class _View:
    """A typed view over one step of the kind the subclass names."""

    step: Step

    KIND: ClassVar[str] = ""  # each subclass names its kind

    def __post_init__(self) -> None:
        if self.step.kind != self.KIND:
            raise UsageError(f"step {self.step.short_id} is a {self.step.kind} step, "
                             f"not a {self.KIND} step")

    @property
    def timings(self) -> dict[str, Any]:
        return _dict(self.step.meta.get(_TIMINGS))

    @property
    def extra(self) -> dict[str, Any]:
        """What the recorder or importer kept beyond kvtrace's fields ({} for none)."""
        return _dict(self.step.meta.get(_EXTRA))

    @property
    def edit_of(self) -> str | None:
        """The id of the step this one is an edited copy of (a fork with an edit), if any."""
        value = self.step.meta.get(EDIT_OF)
        return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class ModelCall(_View):
    """A model call: the conversation sent, the answer, and what the provider reported."""

    KIND = StepKind.MODEL_CALL

    @staticmethod
    def meta(*, model: str, params: Mapping[str, Any] | None = None,
             usage: Mapping[str, Any] | None = None, timings: Mapping[str, Any] | None = None,
             extra: Mapping[str, Any] | None = None,
             api: ProviderApi = ProviderApi.OPENAI_CHAT,
             workspace: str | None = None) -> dict[str, Any]:
        """The meta a model call is recorded with (None or empty values are not recorded)."""
        meta: dict[str, Any] = {_MODEL: model, _PARAMS: params or None, _USAGE: usage or None,
                                _TIMINGS: timings or None, _EXTRA: extra or None}
        if api != ProviderApi.OPENAI_CHAT:
            meta[_API] = str(api)
        if workspace is not None:  # absent otherwise: older steps keep their ids
            meta[WORKSPACE] = workspace
        return meta

    @property
    def workspace(self) -> str | None:
        """The address of the agent's folder's snapshot taken when this call was asked
        (`record --workspace`; kvtrace/workspace), or None."""
        return workspace_of(self.step)

    @property
    def chat(self) -> ChatView:
        """The call in OpenAI chat shape, whatever API it was spoken in (apis.py)."""
        return chat_view(self.api, self.step.content)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation sent, as OpenAI chat messages."""
        return view_messages(self.api, self.step.content)

    def added_to(self, previous: ModelCall | None) -> tuple[int, list[dict[str, Any]]]:
        """(n, rest): how many leading messages of this call the `previous` call sent or
        answered, and this call's messages after those, in chat shape.

        What a reader of a long run shows of each call: its new messages. Two
        chat calls read in one walk share their history's objects, so the
        check is a pointer comparison per message and only new ones are copied.
        """
        if previous is not None and self.api is previous.api is ProviderApi.OPENAI_CHAT:
            items, before = self.step.content.get("messages"), previous.step.content.get(
                "messages")
            if isinstance(items, list) and isinstance(before, list) and (
                items[: len(before)] == before
            ):
                known = len(before) + (len(items) > len(before)
                                       and items[len(before)] == previous.response)
                return known, [dict(m) for m in items[known:]]
        messages = self.messages
        context = [*previous.messages, previous.response] if previous is not None else []
        known = shared_prefix(context, messages)
        return known, messages[known:]

    @property
    def has_messages(self) -> bool:
        """Whether the step holds its conversation (every model call kvtrace records does)."""
        return isinstance(self.step.content.get(self.conversation_field), list)

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The tool definitions sent, in OpenAI chat shape."""
        return chat_tools(self.api, self.step.content)

    @property
    def response(self) -> Any:
        """The assistant message returned, in chat shape (a string in the oldest recordings)."""
        return chat_response(self.api, self.step.content)

    @property
    def conversation_field(self) -> str:
        """The content field holding the conversation in the call's own API (`messages`...)."""
        return LAYOUTS[self.api].conversation

    @property
    def native(self) -> dict[str, Any]:
        """The call in its own API's shape: its conversation field (`messages` or `input`),
        system prompt (`system` or `instructions`), `tools` and `response`, where present."""
        content = self.step.content
        conversation = LAYOUTS[self.api].conversation
        out = {conversation: content[conversation]} if conversation in content else {}
        out.update(native_request(self.api, content))
        if "response" in content:
            out["response"] = content["response"]
        return out

    @property
    def response_settings(self) -> dict[str, Any]:
        """What the response repeated of the settings it ran with ({} for none)."""
        return _dict(self.step.content.get(RESPONSE_SETTINGS))

    @property
    def recorded_stream(self) -> bytes | None:
        """The SSE body of a streamed call as it arrived, when the recorder kept it."""
        body = self.step.content.get(STREAM_FIELD)
        return body if isinstance(body, bytes) else None

    @property
    def model(self) -> str | None:
        """The model that answered (None when the recording does not say)."""
        model = self.step.meta.get(_MODEL)
        return model if isinstance(model, str) and model else None

    @property
    def request_model(self) -> str | None:
        """The model name the request asked for (the answering model's when not kept apart)."""
        asked = self.extra.get("request_model")
        return asked if isinstance(asked, str) else self.model

    @property
    def api(self) -> ProviderApi:
        value = self.step.meta.get(_API)
        try:
            return ProviderApi(value) if value is not None else ProviderApi.OPENAI_CHAT
        except ValueError:
            return ProviderApi.OPENAI_CHAT

    @property
    def params(self) -> dict[str, Any]:
        """The sampling and tool-choice parameters of the request ({} for none)."""
        return _dict(self.step.meta.get(_PARAMS))

    @property
    def raw_usage(self) -> dict[str, Any]:
        """The provider's usage as recorded ({} when it sent none)."""
        return _dict(self.step.meta.get(_USAGE))

    @property
    def usage(self) -> Usage:
        """The provider's counts, normalised (see usage.py)."""
        return Usage.parse(self.step.meta.get(_USAGE))

    @property
    def output_ids(self) -> list[int] | None:
        """The exact token ids kvtrace generated for the response, when it generated it."""
        ids = self.raw_usage.get(TOKEN_IDS_KEY)
        if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                         for i in ids):
            return list(ids)
        return None

    @property
    def http(self) -> dict[str, Any] | None:
        """The HTTP facts of a recorded exchange (url, status, stream, complete), if any."""
        http = self.extra.get("http")
        return dict(http) if isinstance(http, Mapping) else None

    @property
    def is_complete(self) -> bool:
        """False when the client left before the answer's end (a cut stream)."""
        http = self.http
        return http is None or http.get("complete") is not False

    @property
    def is_seed_chosen(self) -> bool:
        """Whether the server chose the seed (the request did not send one)."""
        return bool(self.extra.get("seed_chosen"))


@dataclass(frozen=True, slots=True)
class ToolCall(_View):
    """A tool call: which tool, its arguments, and its result or error."""

    KIND = StepKind.TOOL_CALL

    @staticmethod
    def meta(*, tool: str, error: str | None = None, call_id: str | None = None,
             timings: Mapping[str, Any] | None = None,
             extra: Mapping[str, Any] | None = None,
             key_order: Mapping[str, list[str]] | None = None) -> dict[str, Any]:
        return {_TOOL: tool, _ERROR: error, _CALL_ID: call_id, _TIMINGS: timings or None,
                _EXTRA: extra or None, _KEY_ORDER: dict(key_order) if key_order else None}

    @property
    def tool(self) -> str:
        name = self.step.meta.get(_TOOL)
        return name if isinstance(name, str) else "unknown"

    @property
    def arguments(self) -> Any:
        return self.step.content.get("arguments")

    @property
    def result(self) -> Any:
        return self.step.content.get("result")

    @property
    def returned_result(self) -> Any:
        """The result with its objects' keys in the order the tool returned them."""
        from kvtrace.store.objects.keyorder import in_key_order

        orders = self.step.meta.get(_KEY_ORDER)
        return in_key_order(self.result, orders) if isinstance(orders, dict) else self.result

    @property
    def error(self) -> str | None:
        error = self.step.meta.get(_ERROR)
        return error if isinstance(error, str) else None

    @property
    def call_id(self) -> str | None:
        """The id of the model's tool call this answers (None when not linked)."""
        call_id = self.step.meta.get(_CALL_ID)
        return call_id if isinstance(call_id, str) and call_id else None


@dataclass(frozen=True, slots=True)
class HttpExchange(_View):
    """An HTTP exchange that was not a model call kvtrace understands."""

    KIND = StepKind.HTTP

    @staticmethod
    def meta(*, total_s: float | None, is_complete: bool = True,
             not_model_call: str | None = None) -> dict[str, Any]:
        """`not_model_call`: why an exchange with a model API's path was kept as http."""
        meta: dict[str, Any] = {_TOTAL_S: total_s}
        if not is_complete:
            meta[_COMPLETE] = False
        if not_model_call:
            meta[_NOT_MODEL_CALL] = not_model_call
        return meta

    @property
    def not_model_call(self) -> str | None:
        """Why this exchange, sent to a model API, is not a model_call step (None: not one)."""
        reason = self.step.meta.get(_NOT_MODEL_CALL)
        return reason if isinstance(reason, str) else None

    @property
    def method(self) -> str:
        return str(self.step.content.get("method", ""))

    @property
    def url(self) -> str:
        return str(self.step.content.get("url", ""))

    @property
    def status(self) -> int:
        status = self.step.content.get("status", 200)
        return status if isinstance(status, int) else 200

    @property
    def request_headers(self) -> dict[str, str]:
        return _dict(self.step.content.get("request_headers"))

    @property
    def response_headers(self) -> dict[str, str]:
        return _dict(self.step.content.get("response_headers"))

    @property
    def request_body(self) -> bytes:
        body = self.step.content.get("request_body", b"")
        return body if isinstance(body, bytes) else b""

    @property
    def response_body(self) -> bytes:
        body = self.step.content.get("response_body", b"")
        return body if isinstance(body, bytes) else b""

    @property
    def total_s(self) -> float | None:
        value = self.step.meta.get(_TOTAL_S)
        return float(value) if isinstance(value, (int, float)) else None

    @property
    def is_complete(self) -> bool:
        return self.step.meta.get(_COMPLETE) is not False


@dataclass(frozen=True, slots=True)
class NoteStep(_View):
    """A note recorded as a step of the run."""

    KIND = StepKind.NOTE

    @staticmethod
    def meta(*, author: str | None) -> dict[str, Any]:
        return {_AUTHOR: author}

    @property
    def text(self) -> str:
        return str(self.step.content.get("text", ""))

    @property
    def author(self) -> str | None:
        author = self.step.meta.get(_AUTHOR)
        return author if isinstance(author, str) else None


class VerdictStep(_View):
    """What a verify command said of a run (kvtrace/workspace/verdicts.py): payload `command`
    and `output` (its tail), meta `exit_code`, `passed`, `seconds`, `timed_out`."""

    KIND = StepKind.VERDICT

    @staticmethod
    def meta(*, exit_code: int, seconds: float, timed_out: bool) -> dict[str, Any]:
        return {_EXIT_CODE: exit_code, _PASSED: exit_code == 0, _SECONDS: round(seconds, 3),
                _TIMED_OUT: timed_out}

    @property
    def command(self) -> str:
        return str(self.step.content.get("command", ""))

    @property
    def output(self) -> str:
        return str(self.step.content.get("output", ""))

    @property
    def exit_code(self) -> int:
        code = self.step.meta.get(_EXIT_CODE)
        return code if isinstance(code, int) else -1

    @property
    def passed(self) -> bool:
        return self.exit_code == 0

    @property
    def seconds(self) -> float:
        value = self.step.meta.get(_SECONDS)
        return float(value) if isinstance(value, int | float) else 0.0

    @property
    def timed_out(self) -> bool:
        return self.step.meta.get(_TIMED_OUT) is True


View = ModelCall | ToolCall | HttpExchange | NoteStep | VerdictStep
_VIEWS: dict[str, type[View]] = {
    StepKind.MODEL_CALL: ModelCall, StepKind.TOOL_CALL: ToolCall,
    StepKind.HTTP: HttpExchange, StepKind.NOTE: NoteStep, StepKind.VERDICT: VerdictStep,
}


def view(step: Step) -> View | None:
    """The typed view of a step of a kind kvtrace records, else None."""
    cls = _VIEWS.get(step.kind)
    return cls(step) if cls is not None else None


def model_calls(steps: list[Step]) -> list[ModelCall]:
    """The model calls among `steps`, in order."""
    return [ModelCall(s) for s in steps if s.kind == StepKind.MODEL_CALL]


def tool_calls(steps: list[Step]) -> list[ToolCall]:
    """The tool calls among `steps`, in order."""
    return [ToolCall(s) for s in steps if s.kind == StepKind.TOOL_CALL]


def is_cut(step: Step) -> bool:
    """Whether `step` holds an answer cut before its end: a model call or HTTP exchange whose
    client left mid-stream. It is shown marked everywhere (summary.py) and never served as
    an answer (tracer/matching.py, tracer/prefix.py)."""
    if step.kind == StepKind.MODEL_CALL:
        return not ModelCall(step).is_complete
    if step.kind == StepKind.HTTP:
        return not HttpExchange(step).is_complete
    return False


CUT_NOTE = "incomplete: the client left before the answer's end"


def edit_of(step: Step) -> str | None:
    """The step a step of any kind is an edited copy of, if it is one."""
    value = step.meta.get(EDIT_OF)
    return value if isinstance(value, str) else None


def _dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def workspace_of(step: Step) -> str | None:
    """The workspace snapshot a step names (a model call recorded with `--workspace`), or
    None, whatever the step's kind."""
    value = step.meta.get(WORKSPACE)
    return value if isinstance(value, str) else None

