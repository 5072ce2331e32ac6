"""A local server keeps transient tensors out of the heap its long-lived KV shares
(kvtrace/allocator.py; the soak's RSS growth, docs/reliability.md).

Each case runs in a new process: glibc's threshold, once raised or fixed,
stays so for the life of the process. The process starts a real local
server on a tiny model and has it answer one request over loopback; then a
large tensor is freed (by default glibc would then serve anything smaller
from the heap) and 96 MiB of 1 MiB tensors allocated. What the heap's free
chunks cannot hold must be mappings of their own (`HeapStats.mapped`),
which `free` gives back whole, not new heap that long-lived chunks pin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtrace.allocator import ENV_THRESHOLD, heap_stats

pytestmark = pytest.mark.skipif(heap_stats() is None, reason="glibc's malloc only")

SCRIPT = r"""
import gc, json, sys
import httpx, torch
from kvtrace.allocator import heap_stats
from kvtrace.engine import KVCache, load_engine
from kvtrace.replay.local import LocalBackend
from kvtrace.serve import BackgroundServer, make_server

engine = load_engine(sys.argv[1], cache_dir=sys.argv[2])
server = make_server(backend=LocalBackend(engine, KVCache(engine, disk_dir=None)), store=None,
                     run="heap")
with BackgroundServer(server.app) as running:
    answer = httpx.post(running.url + "/chat/completions", timeout=120, json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    answer.raise_for_status()
# The request's cyclic garbage (tensors among it) is freed now, not by a collection in the
# middle of the count below, which would take its mapped chunks off `mapped`.
gc.collect()
gc.disable()
torch.empty(30 * 2**20 // 4)  # 30 MiB, mapped, freed: glibc's default threshold rises to it
before = heap_stats()
transients = [torch.ones(2**20 // 4) for _ in range(96)]  # 96 MiB of 1 MiB tensors
after = heap_stats()
print(json.dumps({"mapped": after.mapped - before.mapped, "free_before": before.free_kept}))
"""


def _mapped(tiny_model_folder, tmp_path, **env: str) -> dict[str, int]:
    environ = {k: v for k, v in os.environ.items() if k != ENV_THRESHOLD}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_folder),
                           str(tmp_path / "cache")], capture_output=True, text=True,
                          timeout=300, env={**environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout.splitlines()[-1]))


def test_a_local_server_maps_transient_tensors_outside_the_heap(tiny_model_folder, tmp_path):
    # what the heap's free chunks could not hold is mapped, not added to the heap
    found = _mapped(tiny_model_folder, tmp_path)
    assert found["mapped"] >= 96 * 2**20 - found["free_before"] - 2**20


def test_a_threshold_set_in_the_environment_is_left_as_the_user_chose(tiny_model_folder,
                                                                      tmp_path):
    # 32 MiB (glibc's largest): 1 MiB tensors come from the heap, as the user asked
    assert _mapped(tiny_model_folder, tmp_path, **{ENV_THRESHOLD: str(32 * 2**20)})["mapped"] == 0
