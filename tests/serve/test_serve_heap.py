"""A local server gives its heap's freed pages back between its work (kvtrace/engine/heap.py;
the soak's RSS growth, docs/reliability.md).

The case runs in a new process: glibc's state (its raised mmap threshold, what its arenas
keep) is the process's. The process starts a real local server on a tiny model and has it
answer over loopback first, so that what starting a server allocates (imports, threads, their
arenas) is in RSS before anything is counted. Then it leaves ~96 MiB of freed pages in the
heap, each freed 1 MiB tensor pinned by a live one after it, as transient tensors beside
long-lived ones are, and waits: RSS keeps those pages (nothing gives them back). Then the
server answers once more and idles: its engine thread gives them back.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtrace.engine.heap import IDLE_TRIM_S, heap_stats

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

def ask(url, text):
    answer = httpx.post(url + "/chat/completions", timeout=120, json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": text}]})
    answer.raise_for_status()

engine = load_engine(sys.argv[1], cache_dir=sys.argv[2])
wait = float(sys.argv[3])
server = make_server(backend=LocalBackend(engine, KVCache(engine, disk_dir=None)), store=None,
                     run="heap")
with BackgroundServer(server.app) as running:
    ask(running.url, "hi")
    time.sleep(wait)  # the engine thread's own trim after that answer is behind us
    start = anon_mib()
    torch.empty(30 * 2**20 // 4)  # 30 MiB, mapped, freed: glibc serves smaller ones from the heap
    tensors = [torch.ones(2**20 // 4) for _ in range(192)]  # 1 MiB each, touched
    kept = tensors[1::2]  # every other one stays, so no freed chunk merges with the next
    del tensors
    time.sleep(wait)
    freed = anon_mib()
    ask(running.url, "hello")
    time.sleep(wait)
    after_idle = anon_mib()
print(json.dumps({"start": start, "freed": freed, "after_idle": after_idle}))
"""


def test_a_local_server_gives_freed_heap_pages_back_once_idle(tiny_model_folder, tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_folder),
                           str(tmp_path / "cache"), str(IDLE_TRIM_S * 3)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout.splitlines()[-1])
    # the freed tensors' pages stayed resident while the server was idle with nothing owed
    # (192 MiB touched, 96 of it kept; some may reuse pages already resident)...
    assert rss["freed"] > rss["start"] + 144, rss
    # ...and went back once its engine thread had worked and idled again
    assert rss["after_idle"] < rss["freed"] - 80, rss
