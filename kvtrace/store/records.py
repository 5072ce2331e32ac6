"""Typed, immutable records the store hands out.

Records are snapshots: a `Step` never changes once recorded, and a `RunInfo`
describes a ref at the moment it was read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Step:
    """One recorded step (like a Git commit).

    `payload` maps each content field to the address of its blob; `content`
    holds the decoded values of those blobs (JSON values, or bytes for raw
    payloads such as HTTP bodies). `depth` is the 1-based distance from the root.
    """

    id: str
    parent_id: str | None
    kind: str
    depth: int
    payload: dict[str, str]
    meta: dict[str, Any]
    content: dict[str, Any]
    recorded_at: float

    @property
    def short_id(self) -> str:
        """The first 12 hex characters, as printed by the CLI."""
        return self.id[:12]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (raw bytes are shown as their length)."""
        content = {
            key: (f"<{len(value)} bytes>" if isinstance(value, bytes) else value)
            for key, value in self.content.items()
        }
        return {
            "id": self.id,
            "parent_id": self.parent_id,
            "kind": self.kind,
            "depth": self.depth,
            "payload": self.payload,
            "meta": self.meta,
            "content": content,
            "recorded_at": self.recorded_at,
        }


@dataclass(frozen=True, slots=True)
class Growth:
    """A step's list field (a model call's conversation) as it grows the one before it.

    What `Store.walk_growth` gives for each list field instead of the whole
    list: its length, how many leading items the previous list of that field
    in the walk had too, and the items after those (decoded). A run of n calls
    is read in time and memory for its messages, not for n histories.
    """

    num_items: int
    num_kept: int
    items: list[Any]


@dataclass(frozen=True, slots=True)
class Note:
    """An annotation attached to a step afterwards; the step itself never changes."""

    id: int
    step_id: str
    text: str
    author: str | None
    created_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "step_id": self.step_id,
            "text": self.text,
            "author": self.author,
            "created_at": self.created_at,
        }


@dataclass(frozen=True, slots=True)
class ReflogEntry:
    """One move of a ref: nothing is ever lost, because every move is logged."""

    id: int
    ref: str
    old_head: str | None
    new_head: str | None
    reason: str
    message: str
    created_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "ref": self.ref,
            "old_head": self.old_head,
            "new_head": self.new_head,
            "reason": self.reason,
            "message": self.message,
            "created_at": self.created_at,
        }


@dataclass(frozen=True, slots=True)
class RunInfo:
    """A run (branch) as listed by `Store.runs()`."""

    name: str
    head_id: str | None
    depth: int
    created_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "head_id": self.head_id,
            "depth": self.depth,
            "created_at": self.created_at,
        }


@dataclass(frozen=True, slots=True)
class FsckReport:
    """What `Store.fsck()` checked; a sound store has no `problems`."""

    num_blobs: int
    num_steps: int
    num_refs: int
    num_notes: int
    problems: list[str] = field(default_factory=list)

    @property
    def is_ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.is_ok,
            "num_blobs": self.num_blobs,
            "num_steps": self.num_steps,
            "num_refs": self.num_refs,
            "num_notes": self.num_notes,
            "problems": list(self.problems),
        }


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where two runs part: their last common step and the first step of each after it."""

    common: Step | None
    first_a: Step | None
    first_b: Step | None
    num_only_a: int
    num_only_b: int

    def to_dict(self) -> dict[str, Any]:
        def view(step: Step | None) -> dict[str, Any] | None:
            return step.to_dict() if step else None

        return {
            "common": view(self.common),
            "first_a": view(self.first_a),
            "first_b": view(self.first_b),
            "num_only_a": self.num_only_a,
            "num_only_b": self.num_only_b,
        }


@dataclass(frozen=True, slots=True)
class GraphRow:
    """One step of `Store.graph`: the runs pointing at it and the branches leaving it.

    `num_branches` counts the children of the step off the walked chain;
    `branch_runs` names the runs whose history takes one of them (a branch
    no run takes any more, e.g. after a revert, is counted but unnamed), or
    is None when the store has too many runs to name them cheaply.
    """

    step: Step
    heads: list[str]
    num_branches: int
    branch_runs: list[str] | None

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.step.to_dict(),
            "heads": self.heads,
            "num_branches": self.num_branches,
            "branch_runs": self.branch_runs,
        }
