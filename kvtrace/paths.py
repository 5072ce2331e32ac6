"""Default locations, read from the environment only by entry points.

`$KVTRACE_HOME` holds the trace store (default: `.kvtrace/` in the working
directory, like `.git/`); `$KVTRACE_CACHE` holds converted models and KV blocks
(default: `~/.cache/kvtrace`). Lower layers take explicit paths; only
`open_store`, `load_engine` and the CLI call these.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_home() -> Path:
    """Folder of the embedded SQLite store."""
    return Path(os.environ.get("KVTRACE_HOME") or Path.cwd() / ".kvtrace")


def default_cache_dir() -> Path:
    """Folder of converted models and on-disk KV blocks."""
    env = os.environ.get("KVTRACE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvtrace"
