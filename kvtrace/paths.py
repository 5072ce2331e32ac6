"""Default locations, read from the environment only by entry points.

`$KVTRACE_HOME` holds the trace store (default: `.kvtrace/` in the working
directory, like `.git/`); `$KVTRACE_CACHE` holds converted models and KV blocks
(default: `~/.cache/kvtrace`), and `$KVTRACE_KV_DISK_MAX` bounds its KV blocks
(default: no bound; past it the least recently used are evicted, and the
command says so). Lower layers take explicit paths and budgets; only
`open_store`, `load_engine`, `open_local_backend` and the CLI call these.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvtrace.errors import UsageError

KV_DISK_MAX_ENV = "KVTRACE_KV_DISK_MAX"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


def default_home() -> Path:
    """Folder of the embedded SQLite store."""
    return Path(os.environ.get("KVTRACE_HOME") or Path.cwd() / ".kvtrace")


def default_cache_dir() -> Path:
    """Folder of converted models and on-disk KV blocks."""
    env = os.environ.get("KVTRACE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvtrace"


def kv_disk_budget() -> int | None:
    """Bytes the KV folder may hold (`$KVTRACE_KV_DISK_MAX`), or None for no bound."""
    text = os.environ.get(KV_DISK_MAX_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_size(text)
    except UsageError:
        raise UsageError(f"${KV_DISK_MAX_ENV} is {text!r}, not a byte size (examples: "
                         "500000000, 500M, 20GiB); unset it for no bound") from None


def parse_size(text: str) -> int:
    """Bytes from '1500', '2G', '512MiB', '1.5GB' (k/M/G/T, decimal; Ki/Mi/Gi binary)."""
    match = _SIZE.match(text)
    if match is None:
        raise UsageError(f"not a byte size: {text!r} (examples: 500000000, 500M, 2GiB)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    base = 1024 if unit.endswith("ib") or unit.endswith("i") else 1000
    prefix = unit[:1] if unit[:1] in "kmgt" else ""
    exponent = "kmgt".index(prefix) + 1 if prefix else 0
    return int(number * base**exponent)
