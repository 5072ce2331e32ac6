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
(kernel_probes.py), or the width of a decode forward (decode.py's row
multiple)? Do packed bfloat16 weights give `F.linear`'s bits (packed.py)?
One is a timing, not a question of bits: whether the tiles are clearly the
faster prefill attention kernel here (kernel_probes.py's `flash_is_faster`),
whose answer decides the kernel and so the fingerprint; kept, it cannot flip from one load to the
next, only when the probes are measured again (a new key: an upgrade, other
settings, the file deleted). Measured on a 2-core AVX2 EPYC with the default model in
float32, they cost about 1 s of each start (rows 0.09 s, threads 0.08 s,
attention cuts 0.21 s, decode row multiple 0.65 s, the last on the first
request's path). An answer depends on the weights, the config, the dtype,
the device and its kernels (torch's build, the CPU's model and instruction
set or the GPU), the thread count, torch's precision switches, the
environment's numerics settings (MKL's, oneDNN's, cuBLAS's), kvtrace's
engine code, and whether MKL's strict mode took effect in this process
(not if torch computed before kvtrace set it): so `Probes` keeps it under a
digest of exactly those. The row check (0.09 s), which is what shows the
last, always runs, and its answer is part of the key. Anything else
differing is another key, which probes again; where the CPU cannot be named
(no /proc/cpuinfo), answers are kept in memory only. A stored answer that
is not one the probe can give is measured again. Two processes writing the
file at once may drop each other's new entry: the next load measures it
again. Deleting `probes.json` forgets every answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import threading
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # torch-free to import: the CLI and the benches name these files
    import torch

# Bump when a probe changes what it checks: older answers then stop matching.
PROBES_VERSION = 2
PROBES_FILE = "probes.json"
FINGERPRINTS_FILE = "fingerprints.json"
# Environment variables whose values may change a product's bits (MKL's conditional
# reproducibility, oneDNN's ISA and kernels, ATen's vector width, cuBLAS's and TF32's).
_NUMERICS_ENV_PREFIXES = ("MKL_", "ONEDNN_", "DNNL_", "ATEN_CPU_CAPABILITY", "CUBLAS_",
                          "NVIDIA_TF32_OVERRIDE")
# /proc/cpuinfo fields that differ between a CPU's cores or from moment to moment.
_VOLATILE_CPU_FIELDS = {"processor", "cpu MHz", "bogomips", "BogoMIPS", "core id", "apicid",
                        "initial apicid", "physical id", "siblings", "cpu cores"}

Answer = TypeVar("Answer", bool, int)
YES_NO = (True, False)  # what a yes-or-no probe may answer (`Probes.answer`'s `possible`)


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
    (for `/health` and the tests). Threads may ask at once (two batchers'
    first decodes): one lock, held while a probe runs, so a probe must not
    ask for another's answer.
    """

    def __init__(self, path: Path | None = None, key: str | None = None) -> None:
        self.path = path
        self.key = key
        self.measured: list[str] = []
        self.remembered: list[str] = []
        self._answers: dict[str, Any] = {}
        self._entry: dict[str, Any] | None = None  # this key's stored answers, read once
        self._lock = threading.Lock()

    @classmethod
    def in_memory(cls) -> Probes:
        """Answers kept for this engine only (an engine built by hand, not loaded)."""
        return cls()

    @classmethod
    def in_cache(cls, cache_dir: Path, model_parts: Mapping[str, Any],
                 device: torch.device, threads: int) -> Probes:
        """Answers kept in `cache_dir/probes.json` under the digest of `model_parts` (what
        names the weights and the numerics, model.py's `_model_parts`, with the row check's
        answer), this machine's kernels for `device`, `threads`, torch's precision switches,
        the numerics environment and the engine's code (module docstring)."""
        kernels = _kernels(device)
        if kernels is None:
            return cls.in_memory()
        parts = {
            "probes": PROBES_VERSION,
            "model": dict(model_parts),
            "machine": kernels,
            "threads": threads,
            "torch": _precision_switches(device),
            "env": {name: value for name, value in sorted(os.environ.items())
                    if name.startswith(_NUMERICS_ENV_PREFIXES)},
            "code": _engine_code_digest(),
        }
        blob = json.dumps(parts, sort_keys=True, default=str).encode()
        return cls(cache_dir / PROBES_FILE, hashlib.sha256(blob).hexdigest())

    def answer(self, name: str, probe: Callable[[], Answer],
               possible: tuple[Answer, ...]) -> Answer:
        """The answer of probe `name`, one of `possible`: remembered if known under this key,
        else `probe()`, then remembered."""
        with self._lock:
            if name in self._answers:
                return self._answers[name]
            stored = self._stored().get(name)
            # exactly one of `possible`, of its type: JSON's true is not 1, nor 4 true
            if stored in possible and type(stored) in {type(p) for p in possible}:
                self.remembered.append(name)
                self._answers[name] = stored
                return stored
            found = probe()
            self.measured.append(name)
            self._answers[name] = found
            self._store(name, found)
            return found

    def _stored(self) -> dict[str, Any]:
        if self._entry is None:
            entry = (None if self.path is None or self.key is None
                     else read_memo(self.path).get(self.key))
            self._entry = entry if isinstance(entry, dict) else {}
        return self._entry

    def _store(self, name: str, found: bool | int) -> None:
        if self.path is None or self.key is None:
            return
        memo = read_memo(self.path)
        entry = memo.get(self.key)
        memo[self.key] = {**(entry if isinstance(entry, dict) else {}), name: found}
        write_memo(self.path, memo)


def _kernels(device: torch.device) -> dict[str, Any] | None:
    """What names the kernels a product runs on `device`: the GPU (its model, compute
    capability and multiprocessors: a MIG slice has fewer) and its CUDA, or the CPU (its
    model and features, and the instruction set torch dispatches on); None where the CPU
    cannot be named."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"gpu": props.name, "capability": [props.major, props.minor],
                "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}
    cpu = _cpu_model()
    if cpu is None:
        return None
    return {"cpu": cpu, "machine": platform.machine(),
            "capability": torch.backends.cpu.get_cpu_capability()}


@cache
def _cpu_model() -> str | None:
    """A digest of the first CPU's /proc/cpuinfo block, less what differs between cores
    or moments (x86's model name and flags; ARM's implementer, part and features); None
    where there is no /proc/cpuinfo (not Linux)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    block = []
    for line in info.splitlines():
        if not line.strip():  # the first CPU's block is enough: they are alike
            break
        name, _, value = line.partition(":")
        if name.strip() not in _VOLATILE_CPU_FIELDS:
            block.append(f"{name.strip()}:{value.strip()}")
    return hashlib.sha256("\n".join(block).encode()).hexdigest()


def _precision_switches(device: torch.device) -> dict[str, Any]:
    """torch's process-wide switches that let a product or attention trade bits for speed
    (TF32, reduced-precision reductions, which fused attention kernels may run)."""
    import torch

    switches: dict[str, Any] = {"float32_matmul": torch.get_float32_matmul_precision(),
                                "mkldnn": torch.backends.mkldnn.enabled}
    if device.type == "cuda":
        matmul = torch.backends.cuda.matmul
        switches.update({
            "tf32": matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "bf16_reduced": matmul.allow_bf16_reduced_precision_reduction,
            "fp16_reduced": matmul.allow_fp16_reduced_precision_reduction,
            "sdpa": [torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled(),
                     torch.backends.cuda.math_sdp_enabled()]})
    return switches


@cache
def _engine_code_digest() -> str:
    """A digest of kvtrace's engine modules: the probes and what they check are there, so an
    edit (a developer's checkout, another kvtrace) measures again."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
