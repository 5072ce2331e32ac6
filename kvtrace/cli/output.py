"""`-o FILE`, the same on every command: never replace a file unless `--force` says so.

The file is written under a unique temporary name in FILE's folder, then put
in place in one step: linked (which fails if FILE appeared meanwhile, so a
file of the user's is never replaced) or, with `--force`, renamed over it.
A failed write leaves nothing behind, and FILE as it was.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from kvtrace.errors import UsageError

Force = Annotated[
    bool, typer.Option("--force", help="Replace the -o file if it exists (else: an error).")
]


def check_output(path: Path, *, force: bool) -> None:
    """Refuse, before any work, a FILE that cannot or must not be written."""
    if path.is_dir():
        raise UsageError(f"{path} is a folder: name the file to write")
    if not path.parent.is_dir():
        raise UsageError(f"folder {path.parent} does not exist")
    if path.exists() and not force:
        raise UsageError(f"{path} exists: pass --force to replace it, or choose a new file name")


@contextmanager
def output_file(path: Path, *, force: bool) -> Iterator[Path]:
    """A temporary path to write; on success it becomes `path` (see the module docstring)."""
    check_output(path, force=force)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if force:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise UsageError(f"{path} appeared while writing: choose a new file name") from None
        except OSError as exc:  # a file system without hard links: a plain rename, checked first
            if path.exists():
                raise UsageError(f"{path} appeared while writing: choose a new file name") from exc
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
