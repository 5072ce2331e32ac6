"""Real small and read-only file systems for the disk tier's fault tests.

A tmpfs of a few KiB gives a real ENOSPC, and one remounted read-only a real
EROFS (chmod stops no root, and a mock would not exercise safetensors' own
error). Mounting needs root: elsewhere the tests skip, saying so.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@contextmanager
def tmpfs(path: Path, *, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of `size` at `path` (made), unmounted on exit; skips the test when not root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (a real full or read-only disk)")
    path.mkdir(parents=True, exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {getattr(exc, 'stderr', '') or exc}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def make_read_only(path: Path) -> None:
    """Remount the tmpfs at `path` read-only (writes then fail with EROFS, even as root)."""
    _mount("-o", "remount,ro", str(path))


def fill(path: Path, *, leave: int) -> None:
    """Fill the file system of `path` until at most `leave` bytes are free."""
    stats = os.statvfs(path)
    free = stats.f_bavail * stats.f_frsize
    with (path / "filler").open("wb") as fh:
        fh.write(b"\0" * max(free - leave, 0))
