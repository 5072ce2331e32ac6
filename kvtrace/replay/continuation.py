"""Continue a run live: generate new model steps and record them on the run.

The conversation to continue is rebuilt from the trace: the messages of the
last model call on the run, its response, then one message per tool call
recorded after it (an edited tool result on a fork, typically): a `tool`
message answering its call id in function-calling runs (model calls that
carry `tools` or `tool_calls`: the tools are sent with every request and
tool calls are read from the generated text, see rendering.py), an
``Observation:`` user message in ReAct runs.
A tool call (a ReAct action, toolcall.py, or a function call) runs the Python
callable registered under that name, and both the model call and the tool
call are recorded on the run. The prompt of a continued step extends the
recorded context, so its prefix is reused from the cache: warm when the run
was just recorded, replayed or checked out.

A model that asks for a tool nobody registered stops the continuation with
MissingToolError naming it (the model call that asked is recorded first: it
happened). A tool that raises is recorded as a tool call with `error` set and
the model sees ``Observation: error: ...``: a failing tool is part of the
run, not a crash of kvtrace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtrace.apis.chat import tool_calls_of
from kvtrace.engine.sampling import SamplingParams
from kvtrace.errors import (
    ConflictError,
    MissingToolError,
    ReplayError,
    RunNotFoundError,
    UsageError,
)
from kvtrace.rendering import content_text, parse_arguments, tool_result_content
from kvtrace.replay.backend import Backend, CallRequest, Message
from kvtrace.replay.driver import ProgressCallback
from kvtrace.replay.oracle import PrefixOracle
from kvtrace.replay.recording import (
    expected_output_ids,
    prompt_ids,
    record_generation,
    response_message,
    response_text,
    step_messages,
    step_tools,
)
from kvtrace.replay.report import StepReport
from kvtrace.replay.toolcall import NO_ACTION_NUDGE, observation_message, parse_response
from kvtrace.store import Run, Step, Store, validate_run_name
from kvtrace.store.kinds import StepKind, ToolCall, tool_calls

Tool = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class ContinueResult:
    """What a continuation added to a run."""

    run: str
    new_steps: list[Step]
    reports: list[StepReport]  # one per generated model call, with cache accounting
    final_answer: str | None  # set when the model gave one (the continuation then stops)

    @property
    def is_finished(self) -> bool:
        return self.final_answer is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "new_steps": [
                {"id": s.id, "kind": s.kind, "depth": s.depth,
                 "tool": ToolCall(s).tool if s.kind == StepKind.TOOL_CALL else None}
                for s in self.new_steps
            ],
            "steps": [r.to_dict() for r in self.reports],
            "final_answer": self.final_answer,
        }


def continue_run(
    store: Store,
    run_name: str,
    backend: Backend,
    *,
    steps: int,
    tools: Mapping[str, Tool] | None = None,
    messages: list[Message] | None = None,
    user_message: str | None = None,
    params: SamplingParams | None = None,
    tool_definitions: list[Message] | None = None,
    expected_head: str | None = None,
    on_step: ProgressCallback | None = None,
) -> ContinueResult:
    """Generate up to `steps` new model calls on `run_name`, running registered tools.

    `messages` starts an empty (or new) run from scratch; a run with steps is
    continued from its own trace. `user_message` is appended to that
    conversation first: the next task of a session, which also lets a run
    that ended with a final answer go on. Stops early at a final answer.

    A run whose model calls carry `tools` (or a new run given
    `tool_definitions`) continues in function calling: each request sends
    the tools, tool calls are read from the generated text
    (rendering.parse_assistant_text), each is run and recorded with its
    call id, and its result goes back as a `tool` message; a response without
    tool calls is the final answer. Other runs continue in ReAct text.

    Steps are appended after the head read at the start: if another writer
    (a supervisor's revert, say) moves the run meanwhile, the next append
    raises ConflictError and nothing is built on a history this call did not
    read. `expected_head` makes the start itself a check: a worker passing the
    id of the last step it recorded gets ConflictError when the run moved since.
    """
    if steps < 1:
        raise UsageError(f"steps={steps}: continue needs at least 1 step", param="steps")
    tools = dict(tools or {})
    params = params or SamplingParams()
    validate_run_name(run_name)
    exists = True
    try:
        head = store.head(run_name)
    except RunNotFoundError:
        if messages is None:
            raise RunNotFoundError(
                f"no run named {run_name!r} (see `kvtrace runs`); a new run starts from messages"
            ) from None
        head, exists = None, False
    if expected_head is not None and (head.id if head else None) != expected_head:
        raise ConflictError(
            f"run {run_name!r} moved: its head is {head.short_id if head else 'empty'}, not "
            f"{expected_head[:12]} (a revert or another writer?): read it again and go on"
        )
    path = store.path(head.id) if head is not None else []
    if messages is not None and path:
        raise UsageError(f"run {run_name!r} already has steps: continue it without messages")
    pending: list[Message] = []
    if messages is None:
        state = conversation_at(path, user_message)
        if state.final_answer is not None:
            return ContinueResult(run_name, [], [], state.final_answer)
        conversation, pending = state.messages, state.pending
        definitions = tool_definitions if tool_definitions is not None else state.tools
        follow_up = state.follow_up
    else:
        conversation = [dict(m) for m in messages]
        definitions, follow_up = tool_definitions, user_message
    tokenizer = backend.tokenizer
    oracle = _seeded_oracle(path, backend)
    # Appends go after the head read above (a moved run is a conflict); a new
    # run is created once its first call is answered.
    run: Run | None = Run(store, run_name, head) if exists else None
    new_steps: list[Step] = []
    reports: list[StepReport] = []
    final_answer: str | None = None
    if run is not None and pending:
        conversation += _run_tool_calls(run, pending, tools, head, new_steps)
    if follow_up is not None:
        conversation.append({"role": "user", "content": follow_up})
    for index in range(1, steps + 1):
        prompt_ids = (tokenizer.chat_tokens(conversation, tools=definitions)
                      if tokenizer is not None else None)
        oracle_tokens = oracle.bound(prompt_ids) if prompt_ids is not None else None
        result = backend.generate(CallRequest(conversation, prompt_ids, params,
                                              tools=definitions))
        if run is None:
            store.run(run_name)  # create it if it does not exist yet
            run = Run(store, run_name, None)
        model_step = record_generation(run, conversation, result, model=backend.model,
                                       params=params, tools=definitions)
        new_steps.append(model_step)
        if prompt_ids is not None:
            oracle.add(prompt_ids + list(result.output_ids or []), label=model_step.id)
        report = StepReport.of(index, model_step, result, oracle_tokens=oracle_tokens,
                               output_tokens=len(result.output_ids or []))
        reports.append(report)
        if on_step is not None:
            on_step(index, steps, report)
        response = response_message(model_step)
        conversation = [*conversation, response]
        if definitions is not None:  # function calling
            calls = tool_calls_of(response)
            if not calls:
                final_answer = content_text(response.get("content"))
                break
            conversation += _run_tool_calls(run, calls, tools, model_step, new_steps)
            continue
        parsed = parse_response(result.text)
        if parsed.call is None:
            if parsed.final_answer is not None:
                final_answer = parsed.final_answer
                break
            conversation.append({"role": "user", "content": NO_ACTION_NUDGE})
            continue
        tool = _tool(tools, parsed.call.name, model_step)
        tool_result, error = _call(tool, parsed.call.arguments)
        new_steps.append(run.record_tool_call(parsed.call.name, parsed.call.arguments,
                                              tool_result, error=error))
        conversation.append(observation_message(tool_result, error))
    backend.settle()  # the last output on disk, for a continue in another process
    return ContinueResult(run_name, new_steps, reports, final_answer)


@dataclass(frozen=True, slots=True)
class ConversationState:
    """What a next model call after a path would send, or the answer the path ended with."""

    messages: list[Message]
    final_answer: str | None = None
    pending: list[Message] = field(default_factory=list)  # tool calls asked, not yet answered
    tools: list[Message] | None = None  # the tool definitions (function-calling runs)
    follow_up: str | None = None  # a user message to send after the pending calls' results


def conversation_at(path: list[Step], user_message: str | None = None) -> ConversationState:
    """The messages a next model call would send after `path`, or the final answer.

    The conversation is the last model call's messages and response, then one
    message per tool call recorded after it: a `tool` message answering its
    call id in function-calling runs, an ``Observation:`` in ReAct runs. Tool
    calls the response asked for that no tool step answers are `pending`.
    The state has a final answer (and no messages) when the last response
    gave one, no tool call followed and no `user_message` asks for more.
    """
    last = next((i for i in range(len(path) - 1, -1, -1)
                 if path[i].kind == StepKind.MODEL_CALL), None)
    if last is None:
        raise ReplayError("the run has no model call to continue from: start it with messages")
    model_step = path[last]
    response = response_message(model_step)
    conversation = [*step_messages(model_step), response]
    tool_steps = tool_calls(path[last + 1 :])
    calls = tool_calls_of(response)
    definitions = step_tools(model_step)
    if calls or definitions is not None:
        linked = any(s.call_id for s in tool_steps)
        for index, tool in enumerate(tool_steps):
            call_id = tool.call_id or (calls[index].get("id") if index < len(calls) else None)
            conversation.append(tool_message(call_id, tool.tool, tool.result, tool.error))
        if linked:  # answered by id; else the tool steps answer the calls in order
            answered = {s.call_id for s in tool_steps}
            pending = [c for c in calls if c.get("id") not in answered]
        else:
            pending = calls[len(tool_steps):]
        if user_message is None and not calls and not tool_steps:
            return ConversationState([], final_answer=content_text(response.get("content")))
        # The user's turn follows the results of pending calls, once they are run.
        return ConversationState(conversation, pending=pending, tools=definitions or [],
                                 follow_up=user_message)
    for tool in tool_steps:
        conversation.append(observation_message(tool.result, tool.error))
    if user_message is not None:
        conversation.append({"role": "user", "content": user_message})
    elif not tool_steps:
        parsed = parse_response(response_text(model_step))
        if parsed.is_final:
            return ConversationState([], final_answer=parsed.final_answer)
        conversation.append({"role": "user", "content": NO_ACTION_NUDGE})
    return ConversationState(conversation)


def tool_message(call_id: str | None, name: Any, result: Any, error: Any = None) -> Message:
    """The `tool` message that answers a function call with its result (or error)."""
    message: Message = {"role": "tool", "content": tool_result_content(result, error)}
    if call_id is not None:
        message["tool_call_id"] = call_id
    if isinstance(name, str):
        message["name"] = name
    return message


def _run_tool_calls(
    run: Run, calls: list[Message], tools: Mapping[str, Tool], asked_by: Step | None,
    new_steps: list[Step],
) -> list[Message]:
    """Run function calls with the registered tools, record each, return their tool messages."""
    messages = []
    for call in calls:
        function = call.get("function") or {}
        name = str(function.get("name"))
        arguments = parse_arguments(function.get("arguments"))
        tool = _tool(tools, name, asked_by)
        result, error = _call(tool, arguments)
        new_steps.append(run.record_tool_call(name, arguments, result, error=error,
                                              call_id=call.get("id")))
        messages.append(tool_message(call.get("id"), name, result, error))
    return messages


def _tool(tools: Mapping[str, Tool], name: str, asked_by: Step | None) -> Tool:
    tool = tools.get(name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        where = f" at step {asked_by.short_id}" if asked_by is not None else ""
        raise MissingToolError(
            f"the model asked for tool {name!r}{where}, but no tool of that name is "
            f"registered (registered: {known}); register it and continue the run again"
        )
    return tool


def _seeded_oracle(path: list[Step], backend: Backend) -> PrefixOracle:
    """An oracle that has seen every model call already on the run."""
    oracle = PrefixOracle()
    tokenizer = backend.tokenizer
    if tokenizer is None:
        return oracle
    for step in path:
        if step.kind == StepKind.MODEL_CALL:
            prompt = prompt_ids(tokenizer, step)
            oracle.add(prompt + expected_output_ids(step, tokenizer, prompt), label=step.id)
    return oracle


def _call(tool: Tool, arguments: Any) -> tuple[Any, str | None]:
    """Run a tool; its exception becomes the recorded error (tools are user code)."""
    try:
        return tool(arguments), None
    except Exception as exc:  # any tool failure is data for the model
        return None, f"{type(exc).__name__}: {exc}"
