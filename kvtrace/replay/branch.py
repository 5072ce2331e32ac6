"""Branch out: fork K runs from one step and continue each, sharing the prefix's KV.

The experiment researchers run: from one step (maybe edited: another tool
result, another instruction), K continuations with other seeds, compared. A
fork is one ref row, so the K runs share every step up to the fork point by
id. Their KV is shared the same way: the prefix is rebuilt once (`checkout`
of the first branch), and every branch's first prompt, identical up to its
last token, is then a cache hit, so the prefix is computed once, not K times.
`BranchReport.prefix_computed_tokens` and each branch's `computed_tokens`
show it.

The K branches run at once when the backend can decode them together (a
local backend: `LocalBackend.batching`, kvtrace/engine/batch.py), one
thread each: their generations in flight share one forward per token, and
each gets exactly the tokens it gets alone (a branch run with `n=1` and its
seed). Their first prompts are prefilled one after another on the engine
thread, so one of them computes what follows the checked-out prefix and the
others hit it. Other backends run the branches one after another.

`diverged_at` and `final_output` are the comparison `kvtrace record --from
RUN@K --n K` (serve/agents.py) reuses for its runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from kvtrace.engine.sampling import SamplingParams
from kvtrace.errors import UsageError
from kvtrace.replay.backend import Backend
from kvtrace.replay.continuation import ContinueResult, Tool, continue_run, conversation_at
from kvtrace.replay.driver import checkout
from kvtrace.replay.recording import response_text
from kvtrace.replay.report import Totals
from kvtrace.store import Step, Store
from kvtrace.store.edits import editable_fields, edited_content
from kvtrace.store.kinds import StepKind, edit_of
from kvtrace.store.names import numbered_names

MAX_BRANCHES = 64


@dataclass(frozen=True, slots=True)
class Branch:
    """One continuation of a branch-out."""

    run: str
    seed: int | None
    result: ContinueResult
    diverged_at: int | None  # depth of its first step unlike branch 1's (None: all alike)

    @property
    def totals(self) -> Totals:
        return Totals.of(self.result.reports)

    @property
    def output(self) -> str:
        """The final answer, else the text of the last response."""
        return final_output(self.result.new_steps, self.result.final_answer)

    def to_dict(self) -> dict[str, Any]:
        totals = self.totals
        return {
            "run": self.run,
            "seed": self.seed,
            "steps": len(self.result.new_steps),
            "model_calls": totals.steps,
            "prompt_tokens": totals.prompt_tokens,
            "reused_tokens": totals.reused_tokens,
            "computed_tokens": totals.computed_tokens,
            "output_tokens": totals.output_tokens,
            "final_answer": self.result.final_answer,
            "output": self.output,
            "diverged_at": self.diverged_at,
        }


@dataclass(frozen=True, slots=True)
class BranchReport:
    """K branches from one fork point, and what their shared prefix cost."""

    spec: str
    fork_step: Step  # the step every branch starts from (the edited copy, with an edit)
    prefix_tokens: int  # prompt tokens of the prefix's model calls, rebuilt once
    prefix_computed_tokens: int  # of those, computed (the rest came from the cache)
    branches: list[Branch]

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "fork_step": self.fork_step.id,
            "fork_depth": self.fork_step.depth,
            "edited": edit_of(self.fork_step) is not None,
            "prefix_tokens": self.prefix_tokens,
            "prefix_computed_tokens": self.prefix_computed_tokens,
            "branches": [b.to_dict() for b in self.branches],
        }


def branch_out(
    store: Store,
    spec: str,
    backend: Backend,
    *,
    n: int,
    prefix: str | None = None,
    steps: int = 3,
    tools: Mapping[str, Tool] | None = None,
    params: SamplingParams | None = None,
    seed: int | None = None,
    edit: Mapping[str, Any] | None = None,
) -> BranchReport:
    """Fork `n` runs named `{prefix}-1` ... from step `spec` and continue each `steps` calls.

    Branch i samples with seed `seed + i - 1` (`seed` None: 0), so the K
    branches differ when `params.temperature` > 0 and are reproducible. With
    `edit`, the branches start from a copy of the step at `spec` with those
    content fields replaced (see Store.fork).
    """
    if not 1 <= n <= MAX_BRANCHES:
        raise UsageError(f"n={n}: branch needs between 1 and {MAX_BRANCHES} branches", param="n")
    params = params or SamplingParams(temperature=0.7)
    start = store.show(spec)  # fails at once on a bad spec
    _check_continues(store, spec, edit)
    base = prefix or f"{spec.split('@')[0].split('~')[0]}-branch"
    names = numbered_names(base, n, store.has_run)
    first = store.fork(spec, names[0], edit=edit) if edit else store.fork(spec, names[0])
    fork_step = first.head or start
    for name in names[1:]:
        store.fork(fork_step.id, name)
    first_seed = 0 if seed is None else seed
    seeded = [replace(params, seed=first_seed + index) for index in range(n)]
    with _batching(backend) as batched:
        chosen = batched or backend
        warm = checkout(store, names[0], chosen)

        def run(index: int) -> ContinueResult:
            return continue_run(store, names[index], chosen, steps=steps, tools=tools,
                                params=seeded[index])

        if batched is None:  # the backend cannot decode them together: one after another
            results = [run(index) for index in range(n)]
        else:
            with ThreadPoolExecutor(n, thread_name_prefix="kvtrace-branch") as pool:
                futures = [pool.submit(run, index) for index in range(n)]
            results = [future.result() for future in futures]  # the first error, in order
    prefix_tokens = sum(s.prompt_tokens for s in warm.steps)
    prefix_computed = sum(s.computed_tokens or 0 for s in warm.steps)
    reference = results[0].new_steps
    branches = [Branch(name, chosen_params.seed, result,
                       diverged_at(reference, result.new_steps))
                for name, chosen_params, result in zip(names, seeded, results, strict=True)]
    return BranchReport(spec, fork_step, prefix_tokens, prefix_computed, branches)


def _check_continues(store: Store, spec: str, edit: Mapping[str, Any] | None) -> None:
    """A UsageError, before any run is made, where the step at `spec` (as edited) ends in a
    final answer: its continuations would add no step, and an append-only store could never
    take the K empty runs back."""
    path = store.path(spec)
    if edit:
        step = path[-1]
        if not isinstance(edit, Mapping) or not set(edit) <= editable_fields(step):
            return  # the fork refuses the edit, with its own words
        path = [*path[:-1], replace(step, content=edited_content(step, edit))]
    if conversation_at(path).final_answer is not None:
        raise UsageError(f"{spec} ends in a final answer (a response that calls no tool): a "
                         "branch would have nothing to continue; branch from an earlier step, "
                         "or edit this response to call a tool", param="spec")


@contextmanager
def _batching(backend: Backend) -> Iterator[Backend | None]:
    """`backend` behind an engine thread that decodes generations together, when it is a
    local backend (the thread stopped at the end, unless it was running already); else None."""
    batching = getattr(backend, "batching", None)
    if batching is None:
        yield None
        return
    is_own = getattr(backend, "batcher", None) is None
    batched: Backend = batching()
    try:
        yield batched
    finally:
        close = getattr(batched, "close", None)
        if is_own and callable(close):
            close()


def final_output(steps: Sequence[Step], final_answer: str | None = None) -> str:
    """`final_answer` when there is one, else the text of the last model call's response."""
    if final_answer is not None:
        return final_answer
    calls = [s for s in steps if s.kind == StepKind.MODEL_CALL]
    return response_text(calls[-1]) if calls else ""


def diverged_at(reference: Sequence[Step], steps: Sequence[Step]) -> int | None:
    """Depth of the first step of `steps` whose kind or content differs from `reference`'s
    at the same place (one running out first differs there); None when they are alike."""
    for mine, theirs in zip(steps, reference, strict=False):
        if mine.kind != theirs.kind or mine.content != theirs.content:
            return mine.depth
    if len(steps) != len(reference):
        shorter = min(len(steps), len(reference))
        return (steps[shorter] if shorter < len(steps) else reference[shorter]).depth
    return None
