"""What a replay reports, per model call and in total (kvtrace.cli.render prints it).

Every count is in prompt tokens of the model that replayed.
`reused_tokens` = `memory_tokens` + `disk_tokens` (when the tiers are known);
`computed_tokens` = `prompt_tokens` - `reused_tokens` (the prompt's last token
always counts as computed: its logits give the next token). A remote server
that does not report cached tokens leaves `reused_tokens` (and the tiers, and
the hit rate) as None, printed "?" and explained under the table: a guess
would be worse than no number. The oracle bound is computed by the driver
from token ids (see oracle.py), so it is None only when no tokenizer was
available (a remote backend without `--tokenizer`).

`to_dict()` is the `--json` contract: one object with `steps` (a list) and
`total`, each carrying at least prompt_tokens, reused_tokens,
computed_tokens, hit_rate, oracle_tokens, oracle_hit_rate, prefill_s,
decode_s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtrace.engine.generation import DraftVerdict
    from kvtrace.replay.backend import CallResult
    from kvtrace.replay.engines import EngineFacts
    from kvtrace.store import Step


class ReplayMode(StrEnum):
    """How a replay treats each recorded model call (see driver.py)."""

    VERIFY = "verify"  # regenerate the response and compare it with the recording
    REBUILD = "rebuild"  # feed the recorded response: rebuilds the KV state fast


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Where a regenerated response first parts from the recorded one."""

    position: int  # 0-based index in the response's tokens (or characters, see unit)
    expected_id: int | None
    got_id: int | None  # None: the response ended there (or no token ids are known)
    expected_text: str  # the recorded continuation from that token, decoded
    got_text: str  # the regenerated continuation from that token, decoded
    unit: str = "token"  # "char" when the backend gave text only and no tokenizer was known
    tool_call: str | None = None  # how the tool calls differ, when the response has any

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "unit": self.unit,
            "tool_call": self.tool_call,
            "expected_id": self.expected_id,
            "got_id": self.got_id,
            "expected_text": self.expected_text,
            "got_text": self.got_text,
        }


@dataclass(frozen=True, slots=True)
class StepReport:
    """One replayed model call."""

    index: int  # 1-based among the replayed model calls
    step_id: str
    depth: int
    prompt_tokens: int
    reused_tokens: int | None
    memory_tokens: int | None
    disk_tokens: int | None
    computed_tokens: int | None
    oracle_tokens: int | None
    output_tokens: int
    prefill_s: float
    decode_s: float
    is_match: bool | None = None  # verify only
    mismatch: Mismatch | None = None
    draft: DraftVerdict | None = None  # verify: the verdict when the recording was checked
    # The oracle at the model's resume points: the token-exact bound cut back to the last
    # block boundary where a window or state model can resume, or a remote engine's cache
    # (whole blocks) can (= oracle_tokens otherwise).
    oracle_resume_tokens: int | None = None
    # The prompt as the tokenizer that counted the oracle sees it: the engine's own where
    # it has a tokenize endpoint, else --tokenizer, whose template may render more or fewer
    # tokens than prompt_tokens (the engine's count). The oracle's rate is over this.
    oracle_prompt_tokens: int | None = None

    @classmethod
    def of(
        cls,
        index: int,
        step: Step,
        result: CallResult,
        *,
        oracle_tokens: int | None,
        output_tokens: int,
        is_match: bool | None = None,
        mismatch: Mismatch | None = None,
        resume_every: int = 1,
        oracle_prompt_tokens: int | None = None,
    ) -> StepReport:
        """The report of model call `step`, answered by a backend as `result`."""
        return cls(
            index=index,
            step_id=step.id,
            depth=step.depth,
            prompt_tokens=result.prompt_tokens,
            reused_tokens=result.reused_tokens,
            memory_tokens=result.memory_tokens,
            disk_tokens=result.disk_tokens,
            computed_tokens=result.computed_tokens,
            oracle_tokens=oracle_tokens,
            output_tokens=output_tokens,
            prefill_s=result.prefill_s,
            decode_s=result.decode_s,
            is_match=is_match,
            mismatch=mismatch,
            draft=result.draft,
            oracle_resume_tokens=_at_resume(oracle_tokens, resume_every),
            oracle_prompt_tokens=oracle_prompt_tokens,
        )

    @property
    def hit_rate(self) -> float | None:
        return _rate(self.reused_tokens, self.prompt_tokens)

    @property
    def oracle_hit_rate(self) -> float | None:
        return _rate(self.oracle_tokens, self.oracle_prompt_tokens or self.prompt_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "step_id": self.step_id,
            "depth": self.depth,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "memory_tokens": self.memory_tokens,
            "disk_tokens": self.disk_tokens,
            "computed_tokens": self.computed_tokens,
            "hit_rate": _round(self.hit_rate),
            "oracle_tokens": self.oracle_tokens,
            "oracle_hit_rate": _round(self.oracle_hit_rate),
            "oracle_resume_tokens": self.oracle_resume_tokens,
            "oracle_prompt_tokens": self.oracle_prompt_tokens,
            "output_tokens": self.output_tokens,
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "match": self.is_match,
            "mismatch": self.mismatch.to_dict() if self.mismatch else None,
            "draft": None if self.draft is None else str(self.draft),
        }


@dataclass(frozen=True, slots=True)
class Totals:
    """Sums over the replayed model calls; a count is None if any step's is unknown."""

    steps: int
    prompt_tokens: int
    reused_tokens: int | None
    memory_tokens: int | None
    disk_tokens: int | None
    computed_tokens: int | None
    oracle_tokens: int | None
    output_tokens: int
    prefill_s: float
    decode_s: float
    matching_steps: int | None
    first_mismatch: int | None  # index of the first step that differs (verify)
    oracle_resume_tokens: int | None = None  # StepReport's, summed
    oracle_prompt_tokens: int | None = None  # StepReport's, summed

    @classmethod
    def of(cls, steps: Sequence[StepReport]) -> Totals:
        verified = [s for s in steps if s.is_match is not None]
        first = next((s.index for s in steps if s.is_match is False), None)
        return cls(
            steps=len(steps),
            prompt_tokens=sum(s.prompt_tokens for s in steps),
            reused_tokens=_sum(s.reused_tokens for s in steps),
            memory_tokens=_sum(s.memory_tokens for s in steps),
            disk_tokens=_sum(s.disk_tokens for s in steps),
            computed_tokens=_sum(s.computed_tokens for s in steps),
            oracle_tokens=_sum(s.oracle_tokens for s in steps),
            output_tokens=sum(s.output_tokens for s in steps),
            prefill_s=sum(s.prefill_s for s in steps),
            decode_s=sum(s.decode_s for s in steps),
            matching_steps=sum(1 for s in verified if s.is_match) if verified else None,
            first_mismatch=first,
            oracle_resume_tokens=_sum(s.oracle_resume_tokens for s in steps),
            oracle_prompt_tokens=_sum(s.oracle_prompt_tokens for s in steps),
        )

    @property
    def hit_rate(self) -> float | None:
        return _rate(self.reused_tokens, self.prompt_tokens)

    @property
    def oracle_hit_rate(self) -> float | None:
        return _rate(self.oracle_tokens, self.oracle_prompt_tokens or self.prompt_tokens)

    @property
    def oracle_resume_hit_rate(self) -> float | None:
        return _rate(self.oracle_resume_tokens, self.oracle_prompt_tokens or self.prompt_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "memory_tokens": self.memory_tokens,
            "disk_tokens": self.disk_tokens,
            "computed_tokens": self.computed_tokens,
            "hit_rate": _round(self.hit_rate),
            "oracle_tokens": self.oracle_tokens,
            "oracle_hit_rate": _round(self.oracle_hit_rate),
            "oracle_resume_tokens": self.oracle_resume_tokens,
            "oracle_resume_hit_rate": _round(self.oracle_resume_hit_rate),
            "oracle_prompt_tokens": self.oracle_prompt_tokens,
            "output_tokens": self.output_tokens,
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "matching_steps": self.matching_steps,
            "first_mismatch": self.first_mismatch,
        }


@dataclass(frozen=True, slots=True)
class Stopped:
    """Where a replay stopped early: the first model call that does not fit the model's
    context (its prompt and its recorded response, which a rebuild feeds and a verify
    regenerates), and how many model calls from there were not replayed."""

    depth: int
    step_id: str
    prompt_tokens: int
    response_tokens: int
    context: int
    num_skipped: int

    @property
    def needed(self) -> int:
        return self.prompt_tokens + self.response_tokens

    def line(self) -> str:
        calls = f"{self.num_skipped} model call{'' if self.num_skipped == 1 else 's'}"
        return (f"stopped at @{self.depth} ({self.step_id[:12]}): it needs {self.needed:,} "
                f"tokens (prompt {self.prompt_tokens:,} + response {self.response_tokens:,}), "
                f"more than the model's context of {self.context:,}; {calls} from there "
                "not replayed (use a model with a longer context, or --to an earlier step)")

    def to_dict(self) -> dict[str, Any]:
        return {"depth": self.depth, "step": self.step_id, "prompt_tokens": self.prompt_tokens,
                "response_tokens": self.response_tokens, "needed_tokens": self.needed,
                "context": self.context, "skipped_model_calls": self.num_skipped}


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """The outcome of one replay of a run up to a target step."""

    run: str
    target_id: str
    mode: ReplayMode
    backend: str
    model: str
    steps: list[StepReport]
    tool_steps: int  # recorded tool calls served from the trace, never executed
    wall_s: float
    uncached: ReplayReport | None = None  # --compare-uncached: the same replay, no cache
    notes: list[str] = field(default_factory=list)
    stopped: Stopped | None = None  # the steps before it were replayed; it and the rest not
    engine: EngineFacts | None = None  # a remote engine: its tokens and blocks (engines.py)
    engine_counters: dict[str, int] | None = None  # what its cache counters grew by
    reset: str | None = None  # the endpoint that emptied the engine's cache first, if asked

    @property
    def total(self) -> Totals:
        return Totals.of(self.steps)

    @property
    def speedup(self) -> float | None:
        """Uncached wall time over cached wall time (None without a comparison)."""
        if self.uncached is None or self.wall_s <= 0:
            return None
        return self.uncached.wall_s / self.wall_s

    @property
    def is_match(self) -> bool | None:
        """Verify: did every step reproduce its recording? (None in rebuild mode.)"""
        total = self.total
        if total.matching_steps is None:
            return None
        return total.first_mismatch is None

    def to_dict(self) -> dict[str, Any]:
        total = self.total.to_dict()
        total["tool_steps"] = self.tool_steps
        total["wall_s"] = round(self.wall_s, 4)
        if self.uncached is not None:
            total["uncached_wall_s"] = round(self.uncached.wall_s, 4)
            total["speedup"] = _round(self.speedup)
        return {
            "run": self.run,
            "target": self.target_id,
            "mode": str(self.mode),
            "backend": self.backend,
            "model": self.model,
            "steps": [s.to_dict() for s in self.steps],
            "total": total,
            "notes": list(self.notes),
            "stopped": self.stopped.to_dict() if self.stopped is not None else None,
            "engine": None if self.engine is None else self.engine.to_dict(),
            "engine_counters": self.engine_counters,
            "reset": self.reset,
        }


def _rate(part: int | None, whole: int) -> float | None:
    if part is None:
        return None
    return part / whole if whole else 0.0


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _sum(values: Iterable[int | None]) -> int | None:
    total = 0
    for value in values:
        if value is None:
            return None
        total += value
    return total


def _at_resume(tokens: int | None, every: int) -> int | None:
    """`tokens` cut back to a multiple of `every` (the last point a cache can resume at)."""
    return None if tokens is None else tokens - tokens % max(1, every)
