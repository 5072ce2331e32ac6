"""Verdicts: an experiment's outcome, graded by a command and kept as a step of its run.

`kvtrace record --verify CMD` (with or without `--from` / `--n`) runs CMD
through the shell in each agent's folder once the agent has exited, and
`kvtrace verify RUN --cmd CMD` grades a run after the fact. The outcome is
appended to the run as a step of kind `verdict` (store/kinds.py's
`VerdictStep` reads it):

- payload `command`, and `output`: the tail of what CMD printed (stdout and
  stderr together, at most `MAX_OUTPUT` characters), kept as a tool result
  is: as printed (tracer/redact.py redacts credentials in headers, URLs and
  params, never what a program printed, which the trace must show);
- meta `exit_code`, `passed` (exit code 0), `seconds`, `timed_out`.

A command that runs past its timeout is killed (its whole process group)
and fails with exit code 124, as `timeout(1)` reports it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.store import Step, StepKind, Store
from kvtrace.store.kinds import VerdictStep

MAX_OUTPUT = 4000  # characters of the output's tail kept
DEFAULT_TIMEOUT_S = 600.0
TIMED_OUT = 124


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one verify command said."""

    command: str
    exit_code: int
    seconds: float
    output: str
    timed_out: bool = False

    @property
    def passed(self) -> bool:
        return self.exit_code == 0

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "exit_code": self.exit_code,
                "seconds": round(self.seconds, 3), "output": self.output,
                "timed_out": self.timed_out}


def check_command(command: str | None) -> str | None:
    """A `--verify` / `--cmd` value: None (not asked) or a command with something in it."""
    if command is not None and not command.strip():
        raise UsageError("--verify needs a command, e.g. --verify 'pytest -q'")
    return command


def run_verify(command: str, folder: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               env: dict[str, str] | None = None) -> Verdict:
    """Run `command` through the shell in `folder`; its verdict (module docstring)."""
    if timeout_s <= 0:
        raise UsageError(f"timeout_s={timeout_s:g}: give seconds > 0", param="timeout_s")
    started = time.perf_counter()
    process = subprocess.Popen(command, shell=True, cwd=folder, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=env, start_new_session=True)
    timed_out = False
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
    seconds = time.perf_counter() - started
    code = TIMED_OUT if timed_out else process.returncode
    if code < 0:  # killed by a signal: as the shell reports it
        code = 128 - code
    return Verdict(command, code, seconds, _tail(out.decode("utf-8", "replace")), timed_out)


def record_verdict(store: Store, run: str, verdict: Verdict) -> Step:
    """Append `verdict` to `run` (made if it has no step yet) as a `verdict` step."""
    return store.run(run).record(
        StepKind.VERDICT, {"command": verdict.command, "output": verdict.output},
        meta=VerdictStep.meta(exit_code=verdict.exit_code, seconds=verdict.seconds,
                              timed_out=verdict.timed_out))


def verdict_of(step: Step) -> Verdict | None:
    """The verdict a step holds, or None when it is no verdict."""
    if step.kind != StepKind.VERDICT:
        return None
    held = VerdictStep(step)
    return Verdict(held.command, held.exit_code, held.seconds, held.output, held.timed_out)


def run_verdict(store: Store, run: str) -> Verdict | None:
    """A run's verdict: its latest verdict step's, found walking back from its head (verdicts
    are appended last, so this reads one step per graded run), or None."""
    for step in store.log(run, lists=False):
        if step.kind == StepKind.VERDICT:
            return verdict_of(step)
    return None


def runs_by_verdict(store: Store, runs: list[str], wanted: str) -> dict[str, str | None]:
    """The runs among `runs` whose latest verdict is `wanted` ('passed', 'failed', or 'none'
    for no verdict), each with it ('passed', 'failed', None): `runs --verdict`, MCP's
    `list_runs(verdict=)`."""
    if wanted not in ("passed", "failed", "none"):
        raise UsageError(f"verdict={wanted!r}: give passed, failed or none", param="verdict")
    found: dict[str, str | None] = {}
    for run in runs:
        verdict = run_verdict(store, run)
        said = None if verdict is None else "passed" if verdict.passed else "failed"
        if (said or "none") == wanted:
            found[run] = said
    return found


def _tail(text: str) -> str:
    if len(text) <= MAX_OUTPUT:
        return text
    return "…" + text[-(MAX_OUTPUT - 1):]
