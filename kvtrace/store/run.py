"""A run: a named branch that a writer appends steps to.

A `Run` remembers the head it last saw. Each record call appends a step after
that head and moves the ref by compare-and-swap; if another writer moved the
run in between, the call raises ConflictError and nothing is written, so no
step is ever silently lost. `refresh()` re-reads the head to go on from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtrace.apis import LAYOUTS, stored_fields
from kvtrace.apis.plain import to_plain
from kvtrace.errors import UsageError
from kvtrace.store.kinds import (
    RESPONSE_SETTINGS,
    ModelCall,
    NoteStep,
    ProviderApi,
    StepKind,
    ToolCall,
)
from kvtrace.store.objects.lists import Extension

if TYPE_CHECKING:
    from kvtrace.store.records import Step
    from kvtrace.store.store import Store


class Run:
    """A writer on one run of a store."""

    def __init__(self, store: Store, name: str, head: Step | None) -> None:
        self.store = store
        self.name = name
        self._head = head
        self._call: Step | None = None  # the latest model call up to the head, once known

    def __repr__(self) -> str:
        head = self._head.short_id if self._head else None
        return f"Run({self.name!r}, head={head})"

    @property
    def head(self) -> Step | None:
        """The head this writer last saw (None for an empty run)."""
        return self._head

    @property
    def paused(self) -> bool:
        """Whether a supervisor paused this run (its appends then raise RunPausedError)."""
        return self.store.is_paused(self.name)

    def refresh(self) -> Step | None:
        """Re-read the head from the store (after a conflict, say)."""
        self._head = self.store.head(self.name)
        self._call = None
        return self._head

    def record(
        self,
        kind: str | StepKind,
        payload: Mapping[str, Any],
        *,
        meta: Mapping[str, Any] | None = None,
        raw: Mapping[str, bytes] | None = None,
    ) -> Step:
        """Append a step of any kind: JSON `payload` fields, raw-bytes `raw` fields."""
        step = self.store.append(self.name, self._head, kind, payload, meta or {}, raw)
        self._head = step
        if step.kind == StepKind.MODEL_CALL:  # a call without lists: `continues` must look again
            self._call = None
        return step

    def record_model_call(
        self,
        messages: Any,
        response: Any,
        *,
        model: str,
        tools: Any = None,
        params: Mapping[str, Any] | None = None,
        usage: Mapping[str, Any] | None = None,
        timings: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        api: ProviderApi | str = ProviderApi.OPENAI_CHAT,
        system: Any = None,
        raw: Mapping[str, bytes] | None = None,
        prior: list[dict[str, Any]] | None = None,
        response_settings: Mapping[str, Any] | None = None,
        continues: bool = False,
        workspace: str | None = None,
    ) -> Step:
        """Record one model call: the conversation and tools sent, the response received.

        By default messages, response and tools are in OpenAI chat shape (see
        apis/chat.py). With `api="anthropic-messages"` they are the Messages
        API's (`messages`, the response or its content blocks, `tools`, and
        `system`); with `api="openai-responses"` the Responses API's (`input`
        items or a string as `messages`, the response or its output items,
        `tools`, and `instructions` as `system`). Each is stored in its own
        shape and read in chat shape too (apis.py). SDK objects are converted.
        Each message is stored once however many calls send it. `usage` keeps
        the provider's counts as sent, `extra` any fields of an imported
        trajectory that kvtrace does not model. `raw` adds byte fields kept as
        they are (`stream`: the SSE body of a streamed call, `ModelCall.recorded_stream`).
        `prior` (Responses only) holds items that come before the input but are
        not stored with it (a previous response the run does not hold): only
        for checking that each tool output answers a call. `response_settings`
        keeps what a response repeats of the settings it ran with (a Responses
        object's `instructions`, `tools`, `temperature`...): one blob, shared by
        every call of a conversation whose settings stay the same.

        With `continues=True`, `messages` holds only the messages after those
        of the run's previous model call (the latest before the head): the
        call's conversation is that call's, then these. It is stored as the
        whole list would be (same step id), but costs what it adds, not its
        history: what an importer of a long conversation uses. OpenAI chat
        calls only (the other APIs check tool results against the whole
        conversation).

        `workspace`: the address of a snapshot of the agent's folder taken when
        the call was asked (kvtrace/workspace: its tree and files are blobs
        already stored).
        """
        if not isinstance(model, str) or not model:
            raise UsageError("model must name the model that answered (a non-empty string)")
        try:
            api = ProviderApi(api)
        except ValueError:
            raise UsageError(f"api is {api!r}: use one of "
                             f"{', '.join(a.value for a in ProviderApi)}", param="api") from None
        payload, lists = stored_fields(api, messages, response, tools=tools, system=system,
                                       prior=prior)
        given: dict[str, list[Any] | Extension] = dict(lists)
        if continues:
            field = LAYOUTS[api].conversation
            given[field] = Extension(self._previous_call(api), lists[field])
        settings = _mapping(response_settings, "response_settings")
        if settings:
            payload[RESPONSE_SETTINGS] = settings
        meta = ModelCall.meta(
            model=model, params=_mapping(params, "params"), usage=_mapping(usage, "usage"),
            timings=_mapping(timings, "timings"), extra=_mapping(extra, "extra"), api=api,
            workspace=workspace,
        )
        step = self.store.append(self.name, self._head, StepKind.MODEL_CALL, payload, meta,
                                 raw, lists=given)
        self._head = self._call = step
        return step

    def _previous_call(self, api: ProviderApi) -> Step:
        """The run's latest model call up to its head (what `continues=True` extends)."""
        if api is not ProviderApi.OPENAI_CHAT:
            raise UsageError("continues=True is for openai-chat calls: pass the whole "
                             "conversation", param="continues")
        if self._call is None and self._head is not None:
            self._call = next((step for step in self.store.log(self._head.id)
                               if step.kind == StepKind.MODEL_CALL), None)
        if self._call is None:
            raise UsageError(f"continues=True needs an earlier model call in run {self.name!r}",
                             param="continues")
        if ModelCall(self._call).api is not api:
            raise UsageError(f"continues=True: the previous model call {self._call.short_id} "
                             f"is a {ModelCall(self._call).api} call", param="continues")
        return self._call

    def record_tool_call(
        self,
        name: str,
        arguments: Any,
        result: Any,
        *,
        error: str | None = None,
        call_id: str | None = None,
        timings: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        key_order: Mapping[str, list[str]] | None = None,
    ) -> Step:
        """Record one tool call with its arguments and result (or error).

        `call_id` links it to the `tool_calls[i].id` of the model call that asked for it.
        `key_order` is the order of the result's keys where it is not sorted
        (keyorder.py): the tool decorator keeps it, so that a replay hands the
        agent the result as the tool returned it.
        """
        if not isinstance(name, str) or not name:
            raise UsageError("a tool call needs the tool's name (a non-empty string)")
        if error is not None and not isinstance(error, str):
            raise UsageError("error must be a string")
        if call_id is not None and not isinstance(call_id, str):
            raise UsageError("call_id must be a string")
        return self.record(
            StepKind.TOOL_CALL,
            {"arguments": to_plain(arguments), "result": to_plain(result)},
            meta=ToolCall.meta(tool=name, error=error, call_id=call_id,
                               timings=_mapping(timings, "timings"),
                               extra=_mapping(extra, "extra"),
                               key_order=_mapping(key_order, "key_order")),
        )

    def record_note(self, text: str, *, author: str | None = None) -> Step:
        """Record a note as a step of the run (unlike Store.note, which annotates a step)."""
        return self.record(StepKind.NOTE, {"text": text}, meta=NoteStep.meta(author=author))


def _mapping(value: Mapping[str, Any] | None, name: str) -> dict[str, Any] | None:
    """A copy of an optional mapping argument (None or empty: not recorded)."""
    if value is None:
        return None
    plain = to_plain(value)
    if not isinstance(plain, dict):
        raise UsageError(f"{name} must be a mapping (dict), not {type(value).__name__}")
    return plain or None
