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

from dataclasses import dataclass

from kvtrace.errors import KvtraceError, UsageError
from kvtrace.replay.analyze import StepAnalysis, analyze
from kvtrace.replay.backend import Tokenizer
from kvtrace.store import Note, Step, Store
from kvtrace.store.kinds import ModelCall, StepKind
from kvtrace.store.summary import step_summary
from kvtrace.store.usage import Usage

MAX_FORKS = 24  # forks drawn in the graph beyond the runs named (their steps are not listed)


@dataclass(frozen=True, slots=True)
class PageStep:
    """One step of a run as the page lists it."""

    step: Step
    summary: str
    notes: list[Note]
    anchor: str  # the HTML id of its entry
    tokens: StepAnalysis | None  # the oracle bound (None: not a model call, or no tokenizer)
    provider_prompt_tokens: int | None  # as the provider counted (its own tokenizer)
    provider_cached_tokens: int | None  # None: not reported, which is not 0
    also_in: list[str]  # earlier runs of the page whose path holds this step too


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


def gather(store: Store, runs: list[str], tokenizer: Tokenizer | None = None,
           *, tokenizer_name: str | None = None) -> Page:
    """The page's contents for `runs` (names or step addresses), in the order given."""
    if not runs:
        raise UsageError("name at least one run to report on")
    if len(set(runs)) != len(runs):
        raise UsageError("a run is named twice: name each run once")
    paths = {name: store.path(name) for name in runs}
    anchors: dict[str, str] = {}
    holders: dict[str, list[str]] = {}
    page_runs = []
    forks: dict[str, None] = {}
    for index, name in enumerate(runs):
        analyses, problem = _analyses(store, name, tokenizer, bool(paths[name]))
        notes = store.notes_on([step.id for step in paths[name]])
        steps = []
        for step in paths[name]:
            anchor = f"r{index}-s{step.depth}"
            anchors.setdefault(step.id, anchor)
            usage = ModelCall(step).usage if step.kind == StepKind.MODEL_CALL else Usage()
            prompt, cached = usage.prompt_tokens, usage.cached_tokens
            steps.append(PageStep(step, step_summary(step), notes.get(step.id, []), anchor,
                                  analyses.get(step.id), prompt, cached,
                                  list(holders.get(step.id, []))))
            holders.setdefault(step.id, []).append(name)
        leaving = []
        for row in store.graph(name) if paths[name] else []:
            for fork in row.branch_runs or []:
                leaving.append((fork, row.step.depth))
                if fork not in runs:
                    forks.setdefault(fork)
        page_runs.append(PageRun(name, steps, sorted(leaving, key=lambda f: (f[1], f[0])),
                                 problem))
    shown_forks = list(forks)[:MAX_FORKS]
    for fork in shown_forks:
        paths[fork] = store.path(fork)
    lanes = [*runs, *shown_forks]
    return Page(
        runs=page_runs,
        lanes=lanes,
        nodes=_layout(lanes, paths, anchors),
        tokenizer=tokenizer_name if tokenizer is not None else None,
        store_url=store.display_url,
        num_forks_left_out=len(forks) - len(shown_forks),
    )


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


def _layout(lanes: list[str], paths: dict[str, list[Step]],
            anchors: dict[str, str]) -> list[GraphNode]:
    """Each step once, in the lane of the first run holding it, root first."""
    heads: dict[str, list[str]] = {}
    for lane_name in lanes:
        if paths[lane_name]:
            heads.setdefault(paths[lane_name][-1].id, []).append(lane_name)
    placed: dict[str, GraphNode] = {}
    for lane, lane_name in enumerate(lanes):
        for step in paths[lane_name]:
            if step.id not in placed:
                placed[step.id] = GraphNode(step.id, step.parent_id, step.depth, lane, step.kind,
                                            step_summary(step), sorted(heads.get(step.id, [])),
                                            anchors.get(step.id))
    return sorted(placed.values(), key=lambda n: (n.depth, n.lane))
