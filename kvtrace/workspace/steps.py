"""Which snapshot a step names, and what changed in the files between two steps.

`snapshot_at(store, "RUN@K")` is step K's own snapshot: a model call
recorded with `--workspace` names the folder as it was when it was asked.
For a step that is not such a call (a run's head is often a tool call or a
verdict), `latest_snapshot` takes the last one on its path: the folder as
the agent's last call saw it. `file_diff` compares two steps' (or two
runs' heads') folders, with a unified diff of each changed text file.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtrace.errors import UsageError
from kvtrace.store.kinds import workspace_of
from kvtrace.workspace.snapshot import tree_of
from kvtrace.workspace.tree import Change, Tree, changes

if TYPE_CHECKING:
    from kvtrace.store import Step, Store

MAX_DIFF_BYTES = 1_000_000  # a file larger than this on either side is listed, not diffed


def _named(step: Step) -> str | None:
    return workspace_of(step)


def snapshot_at(store: Store, spec: str) -> tuple[Step, Tree]:
    """Step `spec`'s own snapshot; a UsageError saying which steps have one when it has none."""
    step = store.show(spec)
    address = _named(step)
    if address is None:
        having = [f"@{s.depth}" for s in store.path(spec.split("@")[0] if "@" in spec
                                                    else step.id) if _named(s)]
        where = (f"steps with one: {', '.join(having[:20])}" if having else
                 "its run has none: record it with `kvtrace record --workspace DIR`")
        raise UsageError(f"step {spec} has no workspace snapshot ({step.kind}); {where}")
    return step, tree_of(store, address)


def first_snapshot(store: Store, spec: str) -> Tree | None:
    """The first snapshot on the path to `spec`: the folder as the run's first recorded
    call saw it, where a fork of the run starts (`record --from RUN@K --workdir`)."""
    for step in store.path(spec):
        address = _named(step)
        if address is not None:
            return tree_of(store, address)
    return None


def latest_snapshot(store: Store, spec: str) -> tuple[Step, Tree] | None:
    """The last snapshot on the path to `spec` (itself included), or None."""
    for step in reversed(store.path(spec)):
        address = _named(step)
        if address is not None:
            return step, tree_of(store, address)
    return None


@dataclass(frozen=True, slots=True)
class FileDiff:
    """The files that differ between the snapshots at two steps."""

    a: Step
    b: Step
    changes: tuple[Change, ...]
    diffs: dict[str, list[str]]  # unified diff lines of each changed text file

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a.id, "b": self.b.id,
                "files": [{"path": c.path, "status": c.status,
                           "diff": self.diffs.get(c.path)} for c in self.changes]}


def file_diff(store: Store, a: str, b: str) -> FileDiff:
    """What changed in the files from `a`'s snapshot to `b`'s (each the latest on its path)."""
    found = []
    for spec in (a, b):
        latest = latest_snapshot(store, spec)
        if latest is None:
            raise UsageError(f"{spec} has no workspace snapshot on its path: record the run "
                             "with `kvtrace record --workspace DIR`")
        found.append(latest)
    (step_a, tree_a), (step_b, tree_b) = found
    changed = changes(tree_a, tree_b)
    wanted = [blob for c in changed for blob in (
        c.before.blob if c.before else None, c.after.blob if c.after else None)
        if blob is not None]
    contents = store.read_blobs(list(dict.fromkeys(wanted))) if wanted else {}
    diffs = {}
    for change in changed:
        lines = _unified(change, contents)
        if lines is not None:
            diffs[change.path] = lines
    return FileDiff(step_a, step_b, tuple(changed), diffs)


def _unified(change: Change, contents: dict[str, bytes]) -> list[str] | None:
    """The change as unified diff lines, or None for a binary, large, link or omitted file."""
    sides = []
    for entry in (change.before, change.after):
        if entry is None:
            sides.append("")
            continue
        if entry.blob is None:
            return None
        data = contents[entry.blob]
        if len(data) > MAX_DIFF_BYTES or b"\x00" in data:
            return None
        try:
            sides.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            return None
    before = change.path if change.before else "/dev/null"
    after = change.path if change.after else "/dev/null"
    return list(difflib.unified_diff(sides[0].splitlines(), sides[1].splitlines(),
                                     f"a/{before}", f"b/{after}", lineterm=""))
