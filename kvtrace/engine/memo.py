"""What loads remember in the cache folder, so that the next load skips the work.

Two memos live there, both JSON, both only ever a saving (a missing, unreadable
or read-only file means the work is done again):

- `fingerprints.json`: each weight file's SHA-256, keyed by path, size and
  mtime (model.py).
- `probes.json`: the answers of the numerics probes, keyed by everything
  those answers depend on (`Probes`).

The probes ask questions only the model's own products can answer on this
machine: does a row keep its bits whatever the row count (numerics.py), the
thread count (threads.py), the cut of attention into forwards
(attention.py), or the width of a decode forward (decode.py's row
multiple)? Measured on a 2-core EPYC with the default model in bfloat16,
they cost about 1 s of each start (rows 0.09 s, threads 0.08 s, attention
cuts 0.21 s, decode row multiple 0.65 s, the last on the first request's
path). An answer depends only on the weights, the config, the dtype, the
device and its kernels (torch's build, the CPU's instruction set or the GPU),
the thread count and the environment's numerics settings (MKL's, oneDNN's),
so `Probes` keeps it under a digest of exactly those and of `PROBES_VERSION`.
Anything else differing is another key, which probes again. Deleting
`probes.json` forgets every answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # torch-free to import: the CLI and the benches name these files
    import torch

# Bump when a probe changes what it checks: older answers then stop matching.
PROBES_VERSION = 1
PROBES_FILE = "probes.json"
FINGERPRINTS_FILE = "fingerprints.json"
# Environment variables whose values may change a product's bits (MKL's conditional
# reproducibility, oneDNN's ISA and kernels, ATen's vector width).
_NUMERICS_ENV_PREFIXES = ("MKL_", "ONEDNN_", "DNNL_", "ATEN_CPU_CAPABILITY")

Answer = TypeVar("Answer", bool, int)


def read_memo(path: Path) -> dict[str, Any]:
    """The memo at `path`; empty where it is missing or unreadable."""
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def write_memo(path: Path, data: Mapping[str, Any]) -> None:
    """Replace the memo at `path` whole (a reader sees the old file or the new one). Best
    effort: the memo only saves time, so a read-only or full cache folder skips it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, sort_keys=True, indent=0)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


class Probes:
    """One loaded model's probe answers: remembered under its key, else measured and kept.

    `measured` and `remembered` name the probes each way, in the order asked
    (for `/health` and the tests). Threads may ask at once (the batcher's
    first decode beside a load's checks): one lock.
    """

    def __init__(self, path: Path | None = None, key: str | None = None) -> None:
        self.path = path
        self.key = key
        self.measured: list[str] = []
        self.remembered: list[str] = []
        self._answers: dict[str, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def in_memory(cls) -> Probes:
        """Answers kept for this engine only (an engine built by hand, not loaded)."""
        return cls()

    @classmethod
    def in_cache(cls, cache_dir: Path, model_parts: Mapping[str, Any],
                 device: torch.device, threads: int) -> Probes:
        """Answers kept in `cache_dir/probes.json` under the digest of `model_parts` (what
        names the weights and the numerics: model.py's `_model_parts`), this machine's
        kernels for `device`, `threads` and the numerics environment."""
        parts = {
            "probes": PROBES_VERSION,
            "model": dict(model_parts),
            "machine": _kernels(device),
            "threads": threads,
            "env": {name: value for name, value in sorted(os.environ.items())
                    if name.startswith(_NUMERICS_ENV_PREFIXES)},
        }
        blob = json.dumps(parts, sort_keys=True, default=str).encode()
        return cls(cache_dir / PROBES_FILE, hashlib.sha256(blob).hexdigest())

    def answer(self, name: str, probe: Callable[[], Answer]) -> Answer:
        """The answer of probe `name`: remembered if known under this key, else `probe()`,
        then remembered."""
        with self._lock:
            if name in self._answers:
                return self._answers[name]
            stored = self._stored().get(name)
            if isinstance(stored, bool | int):
                self.remembered.append(name)
                self._answers[name] = stored
                return stored  # type: ignore[return-value]
            found = probe()
            self.measured.append(name)
            self._answers[name] = found
            self._store(name, found)
            return found

    def _stored(self) -> dict[str, Any]:
        if self.path is None or self.key is None:
            return {}
        entry = read_memo(self.path).get(self.key)
        return entry if isinstance(entry, dict) else {}

    def _store(self, name: str, found: bool | int) -> None:
        if self.path is None or self.key is None:
            return
        memo = read_memo(self.path)
        entry = memo.get(self.key)
        memo[self.key] = {**(entry if isinstance(entry, dict) else {}), name: found}
        write_memo(self.path, memo)


def _kernels(device: torch.device) -> dict[str, Any]:
    """What names the kernels a product runs on `device`: the GPU and its CUDA, or the
    CPU (its model and instruction set as torch dispatches on them)."""
    import torch

    if device.type == "cuda":
        return {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return {"cpu": _cpu_model(), "machine": platform.machine(),
            "capability": torch.backends.cpu.get_cpu_capability()}


def _cpu_model() -> str:
    """The CPU's model name and flags (Linux's /proc/cpuinfo), else what `platform` says."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    fields: dict[str, str] = {}
    for line in info.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
        if not line.strip():  # the first CPU's block is enough: they are alike
            break
    flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:16]
    return f"{fields.get('model name', platform.processor())} flags:{flags}"
