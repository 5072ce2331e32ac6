"""Continue a run live: generate new model steps and record them on the run.

The conversation to continue is rebuilt from the trace: the messages of the
last model call on the run, its response, then one observation message per
tool call recorded after it (an edited tool result on a fork, typically).
Each new response is parsed as ReAct (toolcall.py); a tool call runs the
Python callable registered under that name, and both the model call and the
tool call are recorded on the run. The prompt of a continued step extends the
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
from dataclasses import dataclass
from typing import Any

from kvtrace.errors import MissingToolError, ReplayError, RunNotFoundError, UsageError
from kvtrace.replay.backend import Backend, CallRequest, Message, SamplingParams
from kvtrace.replay.driver import ProgressCallback
from kvtrace.replay.oracle import PrefixOracle
from kvtrace.replay.recording import (
    assistant_message,
    expected_output_ids,
    record_generation,
    response_text,
    step_messages,
)
from kvtrace.replay.report import StepReport
from kvtrace.replay.toolcall import NO_ACTION_NUDGE, observation_message, parse_response
from kvtrace.store import Run, Step, Store, validate_run_name

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
                {"id": s.id, "kind": s.kind, "depth": s.depth, "tool": s.meta.get("tool")}
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
    on_step: ProgressCallback | None = None,
) -> ContinueResult:
    """Generate up to `steps` new model calls on `run_name`, running registered tools.

    `messages` starts an empty (or new) run from scratch; a run with steps is
    continued from its own trace. `user_message` is appended to that
    conversation first: the next task of a session, which also lets a run
    that ended with a final answer go on. Stops early at a final answer.
    """
    if steps < 1:
        raise UsageError("continue needs --steps of at least 1")
    tools = dict(tools or {})
    params = params or SamplingParams()
    validate_run_name(run_name)
    try:
        head = store.head(run_name)
    except RunNotFoundError:
        if messages is None:
            raise RunNotFoundError(
                f"no run named {run_name!r} (see `kvtrace runs`); a new run starts from messages"
            ) from None
        head = None
    path = store.path(head.id) if head is not None else []
    if messages is not None and path:
        raise UsageError(f"run {run_name!r} already has steps: continue it without messages")
    if messages is None:
        conversation, final = conversation_at(path, user_message)
        if final is not None:
            return ContinueResult(run_name, [], [], final)
    else:
        conversation = [dict(m) for m in messages]
        if user_message is not None:
            conversation.append({"role": "user", "content": user_message})
    tokenizer = backend.tokenizer
    oracle = _seeded_oracle(path, backend)
    # Appends go after the head read above, so a run another writer moved in the
    # meantime is a ConflictError, never silently built upon. A new run is
    # created once its first call is answered.
    run: Run | None = Run(store, run_name, head) if head is not None else None
    new_steps: list[Step] = []
    reports: list[StepReport] = []
    final_answer: str | None = None
    for index in range(1, steps + 1):
        prompt_ids = tokenizer.chat_tokens(conversation) if tokenizer is not None else None
        oracle_tokens = oracle.bound(prompt_ids) if prompt_ids is not None else None
        result = backend.generate(CallRequest(conversation, prompt_ids, params))
        if run is None:
            store.run(run_name)  # create it if it does not exist yet
            run = Run(store, run_name, None)
        model_step = record_generation(run, conversation, result, model=backend.model,
                                       params=params)
        new_steps.append(model_step)
        if prompt_ids is not None:
            oracle.add(prompt_ids + list(result.output_ids or []), label=model_step.id)
        report = StepReport.of(index, model_step, result, oracle_tokens=oracle_tokens,
                               output_tokens=len(result.output_ids or []))
        reports.append(report)
        if on_step is not None:
            on_step(index, steps, report)
        conversation = [*conversation, assistant_message(result.text)]
        parsed = parse_response(result.text)
        if parsed.call is None:
            if parsed.final_answer is not None:
                final_answer = parsed.final_answer
                break
            conversation.append({"role": "user", "content": NO_ACTION_NUDGE})
            continue
        tool = tools.get(parsed.call.name)
        if tool is None:
            known = ", ".join(sorted(tools)) or "none"
            raise MissingToolError(
                f"the model asked for tool {parsed.call.name!r} at step {model_step.short_id}, "
                f"but no tool of that name is registered (registered: {known}); register it "
                "and continue the run again"
            )
        tool_result, error = _call(tool, parsed.call.arguments)
        new_steps.append(run.record_tool_call(parsed.call.name, parsed.call.arguments,
                                              tool_result, error=error))
        conversation.append(observation_message(tool_result, error))
    return ContinueResult(run_name, new_steps, reports, final_answer)


def conversation_at(
    path: list[Step], user_message: str | None = None
) -> tuple[list[Message], str | None]:
    """The messages a next model call would send after `path`, or the final answer.

    Returns (messages, None) to go on, or ([], answer) when the last model call
    gave a final answer, no tool call followed it and no `user_message` asks
    for more.
    """
    last = next((i for i in range(len(path) - 1, -1, -1) if path[i].kind == "model_call"), None)
    if last is None:
        raise ReplayError("the run has no model call to continue from: start it with messages")
    model_step = path[last]
    text = response_text(model_step)
    conversation = [*step_messages(model_step), assistant_message(text)]
    tool_steps = [s for s in path[last + 1 :] if s.kind == "tool_call"]
    for step in tool_steps:
        error = step.meta.get("error")
        conversation.append(observation_message(step.content.get("result"), error))
    if user_message is not None:
        conversation.append({"role": "user", "content": user_message})
    elif not tool_steps:
        parsed = parse_response(text)
        if parsed.is_final:
            return [], parsed.final_answer
        conversation.append({"role": "user", "content": NO_ACTION_NUDGE})
    return conversation, None


def _seeded_oracle(path: list[Step], backend: Backend) -> PrefixOracle:
    """An oracle that has seen every model call already on the run."""
    oracle = PrefixOracle()
    tokenizer = backend.tokenizer
    if tokenizer is None:
        return oracle
    for step in path:
        if step.kind == "model_call":
            prompt = tokenizer.chat_tokens(step_messages(step))
            oracle.add(prompt + expected_output_ids(step, tokenizer, prompt), label=step.id)
    return oracle


def _call(tool: Tool, arguments: Any) -> tuple[Any, str | None]:
    """Run a tool; its exception becomes the recorded error (tools are user code)."""
    try:
        return tool(arguments), None
    except Exception as exc:  # any tool failure is data for the model
        return None, f"{type(exc).__name__}: {exc}"
