"""A local server gives its heap's freed pages back between its work (kvtrace/allocator.py;
the soak's RSS growth, docs/reliability.md).

The case runs in a new process: glibc's state (its raised mmap threshold, what its arenas
keep) is the process's. The process leaves ~96 MiB of freed pages in the heap, pinned by small
live chunks between them, as transient tensors beside long-lived ones do; waits; starts a real
local server on a tiny model and has it answer over loopback; and waits again. Before the
server, RSS keeps those pages (nothing gives them back); once the server's engine thread has
been idle after its work, they are back with the kernel.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtrace.allocator import IDLE_TRIM_S, heap_stats

pytestmark = pytest.mark.skipif(heap_stats() is None, reason="glibc's malloc only")

SCRIPT = r"""
import json, sys, time
import httpx, torch
from kvtrace.engine import KVCache, load_engine
from kvtrace.replay.local import LocalBackend
from kvtrace.serve import BackgroundServer, make_server

def anon_mib():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024

engine = load_engine(sys.argv[1], cache_dir=sys.argv[2])
wait = float(sys.argv[3])
torch.empty(30 * 2**20 // 4)  # 30 MiB, mapped, freed: glibc now serves smaller ones from the heap
kept, transients = [], []
for _ in range(96):  # 1 MiB tensors, each followed by a small chunk that stays
    transients.append(torch.ones(2**20 // 4))
    kept.append(bytearray(4096))
del transients
freed = anon_mib()
time.sleep(wait)
before_server = anon_mib()
server = make_server(backend=LocalBackend(engine, KVCache(engine, disk_dir=None)), store=None,
                     run="heap")
with BackgroundServer(server.app) as running:
    answer = httpx.post(running.url + "/chat/completions", timeout=120, json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    answer.raise_for_status()
    time.sleep(wait)
    after_idle = anon_mib()
print(json.dumps({"freed": freed, "before_server": before_server, "after_idle": after_idle}))
"""


def test_a_local_server_gives_freed_heap_pages_back_once_idle(tiny_model_folder, tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_folder),
                           str(tmp_path / "cache"), str(IDLE_TRIM_S * 3)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout.splitlines()[-1])
    # nothing gives the freed pages back by itself...
    assert rss["before_server"] > rss["freed"] - 8
    # ...the server's engine thread does, once idle after its work (RSS may only grow
    # otherwise: the model's answer added to it)
    assert rss["after_idle"] < rss["before_server"] - 80
