"""What an experiment leaves: the agent's folder as each model call saw it, and its verdict
(docs/experiments.md).

- verdicts.py: a verify command's outcome, kept as a `verdict` step;
- steps.py: which snapshot a step names, and the files two steps differ in;
- tree.py: what a snapshot is (a tree blob naming each file's blob), and
  what differs between two;
- snapshot.py: taking one cheaply (an index of file stats, as git's);
- restore.py: writing one back into a folder.

A model call recorded with `kvtrace record --workspace DIR` names its
snapshot in its meta (`ModelCall.workspace`); files and trees are blobs of
the store, so unchanged ones are kept once across steps and runs.
"""

from __future__ import annotations

from kvtrace.workspace.restore import Restored, restore
from kvtrace.workspace.snapshot import Snapshotter, tree_of
from kvtrace.workspace.tree import Change, Entry, Tree, changes

__all__ = ["Change", "Entry", "Restored", "Snapshotter", "Tree", "changes", "restore",
           "tree_of"]
