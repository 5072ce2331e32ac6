"""K experiments at once: an unchanged agent run K times from one fork point, compared.

`kvtrace record --from RUN@K --n K -- CMD` is `make_server(..., from_run=,
agents=make_agents(...))` on a loopback port, then `run_agents`: CMD started
K times at once, agent i with its SDKs pointed at `/a/i/v1` (agents.py) and,
with `--workdir`, its own working folder. One engine answers them all: the
prefix's KV is warmed once, each agent is answered from the recording up to
where it parts, and the live requests in flight are decoded together
(kvtrace/engine/batch.py), each with exactly the tokens it gets alone.

`ExperimentReport.of` then compares the K runs as `kvtrace branch` compares
its branches (replay/branch.py's `diverged_at` and `final_output`: where each
parts from agent 1's run, and its final output), and says what re-running
each from the start would have cost: its own time here, measured, plus the
time the parent's model calls up to step K took when they were recorded
(their recorded `timings.total_s`, summed: the model's time only, not the
agent's own time between calls, so a lower bound).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtrace.replay.branch import diverged_at, final_output
from kvtrace.serve.agents import Agent
from kvtrace.serve.runner import Child, client_env, run_commands
from kvtrace.store import ModelCall, Step, StepKind, Store

if TYPE_CHECKING:
    from kvtrace.serve.app import ChatServer
    from kvtrace.serve.recording import RunStats
    from kvtrace.tracer.prefix import PrefixSummary
    from kvtrace.workspace.verdicts import Verdict


@dataclass(frozen=True, slots=True)
class AgentExit:
    """How one agent's process ended: its exit code and the seconds it ran."""

    agent: Agent
    exit_code: int
    seconds: float


def run_agents(command: Sequence[str], agents: Sequence[Agent], server_url: str,
               environ: Mapping[str, str] | None = None) -> list[AgentExit]:
    """Run `command` once per agent, all at once, each pointed at its own base URL on the
    server whose base URL (with /v1) is `server_url`, in its working folder (made if
    missing); waits for every one (runner.py: SIGTERM and SIGINT go on to them all)."""
    base_env = dict(os.environ if environ is None else environ)
    children = [Child(command, client_env(base_env, agent.base_url(server_url)), agent.workdir)
                for agent in agents]
    ended = run_commands(children)
    return [AgentExit(agent, code, seconds)
            for agent, (code, seconds) in zip(agents, ended, strict=True)]


@dataclass(frozen=True, slots=True)
class AgentRun:
    """One agent's run, and how it compares with agent 1's."""

    agent: Agent
    exit_code: int
    seconds: float  # its process's wall time, measured
    summary: PrefixSummary  # answered from the recording, first live step, where it parted
    steps: tuple[Step, ...]  # its whole path: the parent's steps it was served, then its own
    stats: RunStats | None  # what was recorded live on its fork (None: nothing)
    diverged_at: int | None  # depth of its first step unlike agent 1's (None: alike)
    output: str  # the last response's text
    verdict: Verdict | None = None  # what `--verify` said of it (None: not asked)
    model: str | None = None  # the model that answered its live calls

    @property
    def is_live(self) -> bool:
        return self.summary.first_live_step is not None

    def to_dict(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "run": self.agent.fork, "agent": self.agent.index, "seed": self.agent.seed,
            "workdir": str(self.agent.workdir) if self.agent.workdir else None,
            "exit_code": self.exit_code, "seconds": round(self.seconds, 3),
            "from": self.summary.to_dict(), "steps": len(self.steps),
            "live_calls": stats.calls if stats else 0,
            "prompt_tokens": stats.prompt_tokens if stats else 0,
            "cached_tokens": stats.cached_tokens if stats else 0,
            "completion_tokens": stats.completion_tokens if stats else 0,
            "diverged_at": self.diverged_at, "output": self.output,
            "verdict": self.verdict.to_dict() if self.verdict is not None else None,
            "model": self.model,
        }


@dataclass(frozen=True, slots=True)
class ExperimentReport:
    """K agents from one fork point: each run, and what re-running each would have cost."""

    spec: str
    runs: tuple[AgentRun, ...]
    prefix_recorded_s: float  # the parent's model calls up to step K, as recorded

    @property
    def wall_s(self) -> float:
        """The K agents' time, together (the longest one's)."""
        return max((run.seconds for run in self.runs), default=0.0)

    def rerun_s(self, run: AgentRun) -> float:
        """What re-running this agent from the start would have taken (module docstring)."""
        return self.prefix_recorded_s + run.seconds

    @property
    def rerun_total_s(self) -> float:
        """The K re-runs one after another."""
        return sum(self.rerun_s(run) for run in self.runs)

    def by_model(self) -> list[dict[str, Any]]:
        """Each model's agents, pass rate, tokens and time (`--models`: one entry each)."""
        groups: dict[str | None, list[AgentRun]] = {}
        for run in self.runs:
            groups.setdefault(run.model, []).append(run)
        return [{
            "model": model, "agents": [run.agent.index for run in runs],
            "passed": sum(1 for run in runs if run.verdict is not None and run.verdict.passed),
            "graded": sum(1 for run in runs if run.verdict is not None),
            "prompt_tokens": sum(run.stats.prompt_tokens for run in runs if run.stats),
            "cached_tokens": sum(run.stats.cached_tokens for run in runs if run.stats),
            "completion_tokens": sum(run.stats.completion_tokens for run in runs if run.stats),
            "seconds": round(max(run.seconds for run in runs), 3),
        } for model, runs in groups.items()]

    @property
    def num_passed(self) -> int:
        return sum(1 for run in self.runs if run.verdict is not None and run.verdict.passed)

    @property
    def num_failed(self) -> int:
        return sum(1 for run in self.runs if run.verdict is not None and not run.verdict.passed)

    @property
    def is_verified(self) -> bool:
        return any(run.verdict is not None for run in self.runs)

    @property
    def exit_code(self) -> int:
        """The first agent's exit code that is not 0, else 1 when a verdict failed (as a
        test runner exits), else 0."""
        return next((run.exit_code for run in self.runs if run.exit_code),
                    1 if self.num_failed else 0)

    @classmethod
    def of(cls, store: Store, spec: str, server: ChatServer, exits: Sequence[AgentExit],
           verdicts: Mapping[int, Verdict | None] | None = None) -> ExperimentReport:
        """The report of `exits`, agents of `server` (made with `from_run=spec`), with each
        agent's verdict by its number where it was graded."""
        summaries = getattr(server.answerer, "summaries", None)
        prefixes = getattr(server.answerer, "prefixes", None)
        if summaries is None or prefixes is None:
            raise TypeError("the server answers no agents from a recording (from_run=)")
        paths = []
        for ended in exits:
            prefix = prefixes[ended.agent.index]
            if prefix.is_live:
                paths.append(tuple(store.path(ended.agent.fork)))
            else:  # answered from the recording only: the parent's steps it was served
                served = prefix.served
                paths.append(tuple(store.path(served[-1].id)) if served else ())
        reference = paths[0] if paths else ()
        model_of = getattr(getattr(server.answerer, "inner", None), "model_of", None)
        runs = tuple(
            AgentRun(ended.agent, ended.exit_code, ended.seconds,
                     prefixes[ended.agent.index].summary, path,
                     server.stats.get(ended.agent.fork), diverged_at(reference, path),
                     final_output(path), (verdicts or {}).get(ended.agent.index),
                     model_of(ended.agent.index) if model_of is not None
                     else server.answerer.model)
            for ended, path in zip(exits, paths, strict=True))
        recorded = sum(float(ModelCall(step).timings.get("total_s") or 0.0)
                       for step in store.path(spec) if step.kind == StepKind.MODEL_CALL)
        return cls(spec, runs, recorded)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec, "agents": [run.to_dict() for run in self.runs],
            "wall_s": round(self.wall_s, 3),
            "prefix_recorded_s": round(self.prefix_recorded_s, 3),
            "rerun_s": [round(self.rerun_s(run), 3) for run in self.runs],
            "rerun_total_s": round(self.rerun_total_s, 3),
            "rerun_source": "the parent's recorded model-call durations up to step K, plus "
                            "each agent's own time here (measured)",
            "exit_code": self.exit_code,
            **({"passed": self.num_passed, "failed": self.num_failed} if self.is_verified
               else {}),
            "models": self.by_model(),
        }
