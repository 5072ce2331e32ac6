"""Writing a snapshot back into a folder: the files as they were when a call was asked.

`restore` refuses a folder that is not empty unless told to write into it
(`force`); then it writes each path of the tree (files with their mode,
links as links) and nothing else: a file the tree does not name is left as
it is. A path never leaves the folder: tree.py refuses '..' and absolute
paths, and a path whose parent inside the folder is a link (made by the
folder's owner, or by this tree) is refused rather than written through.
Files over the size limit were kept by hash only: they are listed, not
written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvtrace.errors import UsageError
from kvtrace.workspace.tree import Tree

if TYPE_CHECKING:
    from kvtrace.store import Store


@dataclass(slots=True)
class Restored:
    """What `restore` wrote."""

    folder: str
    num_files: int = 0
    num_links: int = 0
    num_bytes: int = 0
    omitted: list[str] = field(default_factory=list)  # over the size limit: not kept


def restore(store: Store, tree: Tree, folder: Path, *, force: bool = False) -> Restored:
    """Write `tree` into `folder` (made if missing); see the module docstring."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"-o {folder}: not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not force:
        raise UsageError(f"-o {folder} is not empty: give --force to write into it "
                         "(files the snapshot names are overwritten, others left)")
    folder.mkdir(parents=True, exist_ok=True)
    root = folder.resolve()
    done = Restored(str(root))
    blobs = [entry.blob for entry in tree.entries if entry.blob is not None]
    contents = store.read_blobs(blobs)
    for entry in tree.entries:
        target = root / entry.path
        _check_parent(root, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        if entry.link is not None:
            if target.is_symlink() or target.exists():
                target.unlink()
            os.symlink(entry.link, target)
            done.num_links += 1
        elif entry.blob is not None:
            if target.is_symlink():
                target.unlink()  # never write through a link
            data = contents[entry.blob]
            target.write_bytes(data)
            os.chmod(target, entry.mode)
            done.num_files += 1
            done.num_bytes += len(data)
        else:
            done.omitted.append(entry.path)
    return done


def _check_parent(root: Path, target: Path) -> None:
    """Refuse a path whose folder, inside `root`, is a link (it could lead outside)."""
    parent = target.parent
    while parent != root:
        if parent.is_symlink():
            raise UsageError(f"{target.relative_to(root)}: its folder "
                             f"{parent.relative_to(root)} is a link; not written through it")
        parent = parent.parent
