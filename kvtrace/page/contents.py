"""What the HTML report shows, gathered from the store as records (render.py writes the page).

`gather(store, runs, tokenizer)` reads, for each run named: every step of
its path with a one-line summary, its notes, the provider's token counts
(`meta.usage`), and, with a tokenizer, the oracle bound of each model call
(`kvtrace.replay.analyze`: tokens an exact-prefix cache could reuse and
tokens it must compute). It also lays out the branch graph: the runs named
and the forks leaving them (`Store.graph`), each step once, in the lane of
the first run that holds it, so shared prefixes are drawn once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from kvtrace.errors import KvtraceError, UsageError
from kvtrace.replay.analyze import StepAnalysis, analyze
from kvtrace.replay.backend import Tokenizer
from kvtrace.store import Growth, Note, OnStep, ProviderApi, Step, Store
from kvtrace.store.kinds import ModelCall, StepKind
from kvtrace.store.present.summary import step_summary
from kvtrace.store.usage import Usage

MAX_FORKS = 24  # forks drawn in the graph beyond the runs named (their steps are not listed)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A model call's messages as the page shows them: their number, and the new ones."""

    num_messages: int
    num_known: int  # leading messages the run's previous model call sent or answered
    new: list[dict[str, Any]]  # the rest, in chat shape

    @staticmethod
    def of(call: ModelCall, previous: ModelCall | None) -> Prompt:
        """The prompt of `call`, against the run's previous model call (None: the first)."""
        known, new = call.added_to(previous)
        return Prompt(known + len(new), known, new)

    @staticmethod
    def grown(growth: Growth, sent: int, response: Any) -> Prompt:
        """The prompt of a chat call from how its messages grow the previous chat call's
        (`sent` messages, then `response`): what `of` finds, without either whole list."""
        known = growth.num_kept
        if known == sent and growth.items and growth.items[0] == response:
            known += 1  # the previous call's answer, sent back
        return Prompt(growth.num_items, known,
                      [dict(m) for m in growth.items[known - growth.num_kept:]])


@dataclass(frozen=True, slots=True)
class PageStep:
    """One step of a run as the page lists it.

    A model call gathered for a page keeps its conversation in `prompt`
    (the messages new since the previous call), not in `step.content`:
    a run of n calls would otherwise hold n copies of its history. A
    PageStep made of a whole step (the UI's live tail) has no prompt.
    """

    step: Step
    summary: str
    notes: list[Note]
    anchor: str  # the HTML id of its entry
    tokens: StepAnalysis | None  # the oracle bound (None: not a model call, or no tokenizer)
    provider_prompt_tokens: int | None  # as the provider counted (its own tokenizer)
    provider_cached_tokens: int | None  # None: not reported, which is not 0
    also_in: list[str]  # earlier runs of the page whose path holds this step too
    prompt: Prompt | None = None  # a model call's messages as shown (see above)


@dataclass(frozen=True, slots=True)
class PageRun:
    """A run named on the command line: its steps and where forks leave it."""

    name: str
    steps: list[PageStep]
    forks: list[tuple[str, int]]  # (run, position of the step it leaves from)
    token_problem: str | None = None  # why there are no token bars, when there is a reason

    @property
    def prompt_tokens(self) -> int:
        return sum(s.tokens.prompt_tokens for s in self.steps if s.tokens)

    @property
    def oracle_tokens(self) -> int:
        return sum(s.tokens.oracle_tokens for s in self.steps if s.tokens)


@dataclass(frozen=True, slots=True)
class GraphNode:
    """A step in the branch graph: its lane (a run) and the runs whose head it is."""

    step_id: str
    parent_id: str | None
    depth: int
    lane: int
    kind: str
    summary: str
    heads: list[str]
    anchor: str | None  # the entry it links to (None: a fork's step, not listed)


@dataclass(frozen=True, slots=True)
class Page:
    """Everything the report shows."""

    runs: list[PageRun]
    lanes: list[str]  # lane i is the run lanes[i] (the runs named, then their forks)
    nodes: list[GraphNode]
    tokenizer: str | None  # the tokenizer's name, None without one
    store_url: str
    num_forks_left_out: int = 0


# A step as the graph places it: (id, parent id, depth, kind, summary).
_Line = tuple[str, str | None, int, str, str]


def gather(store: Store, runs: list[str], tokenizer: Tokenizer | None = None,
           *, tokenizer_name: str | None = None, on_step: OnStep | None = None) -> Page:
    """The page's contents for `runs` (names or step addresses), in the order given."""
    if not runs:
        raise UsageError("name at least one run to report on")
    if len(set(runs)) != len(runs):
        raise UsageError("a run is named twice: name each run once")
    walks = {name: store.walk_growth(name, on_step=on_step) for name in runs}  # unknown: fails
    lines: dict[str, list[_Line]] = {}
    anchors: dict[str, str] = {}
    holders: dict[str, list[str]] = {}
    page_runs = []
    forks: dict[str, None] = {}
    for index, name in enumerate(runs):
        steps = _page_steps(store, walks[name], index, holders)
        for item in steps:
            holders.setdefault(item.step.id, []).append(name)
            anchors.setdefault(item.step.id, item.anchor)
        lines[name] = [(s.step.id, s.step.parent_id, s.step.depth, s.step.kind, s.summary)
                       for s in steps]
        analyses, problem = _analyses(store, name, tokenizer, bool(steps))
        notes = store.notes_on([item.step.id for item in steps])
        steps = [replace(item, tokens=analyses.get(item.step.id),
                         notes=notes.get(item.step.id, [])) for item in steps]
        leaving = store.forks(name) if steps else []
        for fork, _ in sorted(leaving, key=lambda f: (-f[1], f[0])):  # head first, as drawn
            if fork not in runs:
                forks.setdefault(fork)
        page_runs.append(PageRun(name, steps, leaving, problem))
    shown_forks = list(forks)[:MAX_FORKS]
    for fork in shown_forks:
        lines[fork] = [(s.id, s.parent_id, s.depth, s.kind, step_summary(s))
                       for s in store.walk(fork, lists=False)]
    lanes = [*runs, *shown_forks]
    return Page(
        runs=page_runs,
        lanes=lanes,
        nodes=_layout(lanes, lines, anchors),
        tokenizer=tokenizer_name if tokenizer is not None else None,
        store_url=store.display_url,
        num_forks_left_out=len(forks) - len(shown_forks),
    )


def _page_steps(store: Store, walk: Iterator[tuple[Step, dict[str, Growth]]], index: int,
                holders: dict[str, list[str]]) -> list[PageStep]:
    """The steps of one run as the page lists them (no tokens, no notes yet).

    Read with `Store.walk_growth`: a model call comes with the messages it
    adds to the previous call's, never with its whole conversation.
    """
    steps: list[PageStep] = []
    previous: ModelCall | None = None
    sent = 0  # the messages of the previous model call
    last_list: dict[str, str] = {}  # the walk's latest step with each list field
    whole: ModelCall | None = None  # the previous call read whole, when it was
    for step, grown in walk:
        prompt, usage = None, Usage()
        if step.kind == StepKind.MODEL_CALL:
            call = ModelCall(step)
            usage = call.usage
            growth = grown.get(call.conversation_field)
            if growth is not None and previous is not None and (
                call.api is previous.api is ProviderApi.OPENAI_CHAT
                and last_list.get(call.conversation_field) == previous.step.id
            ):
                prompt, whole = Prompt.grown(growth, sent, previous.response), None
            else:  # the first call, or one in another API or after one: read whole
                before = whole if whole is not None or previous is None else ModelCall(
                    store.show(previous.step.id))
                whole = ModelCall(store.show(step.id))
                prompt = Prompt.of(whole, before)
            previous, sent = call, prompt.num_messages
        last_list.update((field, step.id) for field in grown)
        steps.append(PageStep(step, step_summary(step), [], f"r{index}-s{step.depth}", None,
                              usage.prompt_tokens, usage.cached_tokens,
                              list(holders.get(step.id, [])), prompt))
    return steps


def _analyses(store: Store, name: str, tokenizer: Tokenizer | None,
              has_steps: bool) -> tuple[dict[str, StepAnalysis], str | None]:
    """The oracle bound of each model call of `name`, or why there is none."""
    if tokenizer is None or not has_steps:
        return {}, None
    try:
        analysis = analyze(store, name, tokenizer)
    except KvtraceError as exc:  # e.g. a chat template that cannot render these messages
        return {}, str(exc)
    return {s.step_id: s for s in analysis.steps}, None


def _layout(lanes: list[str], lines: dict[str, list[_Line]],
            anchors: dict[str, str]) -> list[GraphNode]:
    """Each step once, in the lane of the first run holding it, root first."""
    heads: dict[str, list[str]] = {}
    for lane_name in lanes:
        if lines[lane_name]:
            heads.setdefault(lines[lane_name][-1][0], []).append(lane_name)
    placed: dict[str, GraphNode] = {}
    for lane, lane_name in enumerate(lanes):
        for step_id, parent_id, depth, kind, summary in lines[lane_name]:
            if step_id not in placed:
                placed[step_id] = GraphNode(step_id, parent_id, depth, lane, kind, summary,
                                            sorted(heads.get(step_id, [])),
                                            anchors.get(step_id))
    return sorted(placed.values(), key=lambda n: (n.depth, n.lane))
