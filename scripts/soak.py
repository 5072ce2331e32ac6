"""Soak test of `kvtrace serve` (local mode): N concurrent clients for T seconds, on loopback.

    .venv/bin/python scripts/soak.py --clients 4 --seconds 60 [--model tiny|PATH]

Starts the server in its own process (the same ChatServer and uvicorn runner
as `kvtrace serve`, on 127.0.0.1, port chosen by the kernel) with a new
SQLite store and KV folder in a temporary directory and explicit cache
budgets; then N client threads (httpx) send chat requests in turn: plain,
streamed (with usage), with tools and a tool turn, extending one
conversation the clients share (each answer appended, so prefixes are
reused; it starts again past 24 messages), and two kinds of clients that
leave: one that gives up on a long answer after 0.3 s (a client timeout)
and one that drops a stream after its first event. It prints one JSON
object: requests served and errors (target 0), p50/p95 latency, the
server's RSS after a warm-up request, every T/12 seconds and at the end,
its growth against a budget of what the server may rightly keep
(soak_memory.py's `rss_budget`: the memory tier's KV, the tier's own
objects, the store's caches of the recorded run, plus --other-mib), the
disk tier's size against its budget, and the store's fsck after the server
stopped, with what was recorded checked request by request (each request's
last message carries a tag): every answer a client received recorded once,
complete; no answer a client gave up on recorded as complete; a dropped
stream recorded at most once. Exit code 1 when an error, a missing or
duplicated step, an undelivered answer recorded complete, fsck problems or
RSS growth past the budgets shows up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from soak_memory import Probe, RssSampler, rss_budget, server_state  # beside this file

RUN = "soak"
MAX_TOKENS = 12
LONG_TOKENS = 1000  # an answer no client waits for: seconds of decoding on any model here
GIVE_UP_S = 0.3
KINDS = ("plain", "stream", "tools", "shared", "gives_up", "drops_stream")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--model", default=None,
                        help="a model folder, 'tiny' (a random 2-layer model, for smoke "
                        "tests), or the embedded default model when omitted")
    parser.add_argument("--memory-mib", type=int, default=64, help="KV memory tier budget")
    parser.add_argument("--disk-mib", type=int, default=256, help="KV disk tier budget")
    parser.add_argument("--other-mib", type=int, default=16,
                        help="RSS growth allowed besides the KV memory tier, its objects and "
                        "the store's caches (SQLite's page cache, the allocator's slack)")
    parser.add_argument("--probe-memory", metavar="OUT", type=Path,
                        help="write the server's memory samples to OUT (scripts/soak_memory.py)")
    parser.add_argument("--probe-every", type=float, default=30.0,
                        help="seconds between memory samples (with --probe-memory)")
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                        help="trace Python allocations with FRAMES frames and dump a snapshot "
                        "at each sample (with --probe-memory; slows the server)")
    parser.add_argument("--serve", metavar="FOLDER", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)
    if args.serve:
        return _serve(Path(args.serve), args)
    if args.clients < 1 or args.seconds <= 0:
        parser.error("--clients must be >= 1 and --seconds > 0")
    with tempfile.TemporaryDirectory(prefix="kvtrace-soak-") as folder:
        report = soak(Path(folder), args)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


# -- the server process ---------------------------------------------------------------------


def _serve(folder: Path, args: argparse.Namespace) -> int:
    """Run the server until stdin closes; print its URL once it accepts connections."""
    from kvtrace import open_store
    from kvtrace.engine import KVCache, build_tiny_model, default_model_dir, load_engine
    from kvtrace.paths import default_cache_dir
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve import BackgroundServer, make_server

    model: str | Path | None = args.model
    if model == "tiny":
        model = build_tiny_model(folder / "tiny-model", seed=5,
                                 tokenizer_dir=default_model_dir(default_cache_dir()))
    engine = load_engine(model, cache_dir=default_cache_dir())
    cache = KVCache(engine, disk_dir=folder / "kv", memory_bytes=args.memory_mib * 2**20,
                    disk_bytes=args.disk_mib * 2**20)
    with open_store(f"sqlite:///{folder / 'store.db'}") as store:
        server = make_server(backend=LocalBackend(engine, cache), store=store, run=RUN,
                             max_queue=max(16, args.clients))
        probe = None
        if args.probe_memory:
            probe = Probe(args.probe_memory, every_s=args.probe_every, frames=args.tracemalloc,
                          store=store, cache=cache)
        with BackgroundServer(server.app) as running:
            print(json.dumps({"url": running.url, "model": engine.name}), flush=True)
            sys.stdin.readline()  # the warm-up request was answered
            if probe is not None:
                probe.start()
            sys.stdin.read()  # the parent closes it to stop us
            if probe is not None:
                probe.finish()
            print(json.dumps(server_state(store, cache)), flush=True)
    return 0


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# -- the clients ----------------------------------------------------------------------------


class Clients:
    """N threads sending requests in turn until the deadline; results gathered here."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.kinds: dict[str, int] = {}
        self.num_streamed_done = 0
        self.delivered: set[str] = set()  # tags of the answers a client received in full
        self.abandoned: set[str] = set()  # tags of requests whose client gave up before
        self.dropped: set[str] = set()  # tags of streams dropped after their first event
        self._lock = threading.Lock()
        self._conversation: list[dict[str, Any]] = [SYSTEM]

    def run(self, num_clients: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=self._client, args=(i, deadline))
                   for i in range(num_clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _client(self, index: int, deadline: float) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as http:
            turn = index
            while time.monotonic() < deadline:
                kind = KINDS[turn % len(KINDS)]
                turn += 1
                started = time.perf_counter()
                try:
                    is_served = getattr(self, f"_{kind}")(http, index, turn) is not False
                except Exception as exc:  # every failure is counted and named, none stops us
                    with self._lock:
                        self.errors.append(f"{kind}: {type(exc).__name__}: {exc}"[:300])
                    continue
                with self._lock:
                    self.kinds[kind] = self.kinds.get(kind, 0) + 1
                    if is_served:
                        self.latencies.append(time.perf_counter() - started)
                        self.delivered.add(tag(index, turn))

    def _post(self, http: httpx.Client, messages: list[dict[str, Any]],
              **options: Any) -> dict[str, Any]:
        response = http.post("/chat/completions", json={
            "model": self.model, "messages": messages, "max_tokens": MAX_TOKENS, **options})
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        return dict(response.json())

    def _plain(self, http: httpx.Client, index: int, turn: int) -> None:
        self._post(http, [SYSTEM, {"role": "user", "content": f"Client {index}, turn {turn}: "
                                   f"name a colour. {tag(index, turn)}"}])

    def _stream(self, http: httpx.Client, index: int, turn: int) -> None:
        body = {"model": self.model, "max_tokens": MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [SYSTEM, {"role": "user", "content": f"Count to {turn % 7 + 2}. "
                                      f"{tag(index, turn)}"}]}
        with http.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}")
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        if not lines or lines[-1] != "data: [DONE]":
            raise RuntimeError(f"the stream ended without [DONE] after {len(lines)} events")
        with self._lock:
            self.num_streamed_done += 1

    def _tools(self, http: httpx.Client, index: int, turn: int) -> None:
        city = ("Oslo", "Paris", "Lima", "Kyoto")[turn % 4]
        messages: list[dict[str, Any]] = [
            SYSTEM, {"role": "user", "content": f"What is the weather in {city}? "
                     f"{tag(index, turn)}"}]
        if turn % 2:
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"call_{index}_{turn}", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                {"role": "tool", "tool_call_id": f"call_{index}_{turn}",
                 "content": f"sunny, 21 C {tag(index, turn)}"},
            ]
        self._post(http, messages, tools=TOOLS, tool_choice="auto")

    def _shared(self, http: httpx.Client, index: int, turn: int) -> None:
        with self._lock:
            if len(self._conversation) > 24:
                self._conversation = [SYSTEM]
            messages = [*self._conversation,
                        {"role": "user", "content": f"Client {index} adds point {turn}. "
                         f"{tag(index, turn)}"}]
        answer = self._post(http, messages)["choices"][0]["message"]
        with self._lock:
            if len(self._conversation) == len(messages) - 1:  # nobody extended it meanwhile
                self._conversation = [*messages, {"role": "assistant",
                                                  "content": answer.get("content") or ""}]

    def _gives_up(self, http: httpx.Client, index: int, turn: int) -> bool:
        """A client that times out waiting for a long answer; False when it gave up."""
        body = {"model": self.model, "max_tokens": LONG_TOKENS, "messages": [
            SYSTEM, {"role": "user", "content": f"Write a long story. {tag(index, turn)}"}]}
        try:
            response = http.post("/chat/completions", json=body, timeout=GIVE_UP_S)
        except httpx.TimeoutException:
            with self._lock:
                self.abandoned.add(tag(index, turn))
            return False
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        return True  # it was answered within GIVE_UP_S after all: delivered

    def _drops_stream(self, http: httpx.Client, index: int, turn: int) -> bool:
        """A client that reads a stream's first event, then closes the connection."""
        body = {"model": self.model, "max_tokens": MAX_TOKENS, "stream": True, "messages": [
            SYSTEM, {"role": "user", "content": f"Count to nine. {tag(index, turn)}"}]}
        with httpx.stream("POST", f"{self.url}/chat/completions", json=body,
                          timeout=120) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}")
            next(response.iter_lines())
        with self._lock:
            self.dropped.add(tag(index, turn))
        return False


def tag(index: int, turn: int) -> str:
    """The mark of one request, in its last message: how its step is found again."""
    return f"[req {index}.{turn}]"


# -- the soak -------------------------------------------------------------------------------


def soak(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, __file__, "--serve", str(folder), "--clients", str(args.clients),
               "--memory-mib", str(args.memory_mib), "--disk-mib", str(args.disk_mib)]
    if args.model:
        command += ["--model", args.model]
    if args.probe_memory:
        command += ["--probe-memory", str(args.probe_memory.resolve()), "--probe-every",
                    str(args.probe_every), "--tracemalloc", str(args.tracemalloc)]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                             text=True)
    try:
        if child.stdout is None or child.stdin is None:
            raise RuntimeError("the server's pipes are missing")
        ready = child.stdout.readline()
        if not ready:
            raise RuntimeError(f"the server exited with {child.wait()} before it was ready")
        started = json.loads(ready)
        clients = Clients(started["url"], started["model"])
        with httpx.Client(base_url=started["url"], timeout=120) as http:
            clients._plain(http, -1, 0)  # warm-up: torch's first allocations are not growth
        clients.delivered.add(tag(-1, 0))
        child.stdin.write("warm\n")
        child.stdin.flush()
        with RssSampler(child.pid, every_s=max(1.0, args.seconds / 12)) as rss:
            began = time.monotonic()
            clients.run(args.clients, args.seconds)
            elapsed = time.monotonic() - began
            health = httpx.get(started["url"].removesuffix("/v1") + "/health",
                               timeout=120).json()
        disk_bytes = _folder_bytes(folder / "kv")
        child.stdin.close()
        state = json.loads(child.stdout.readline())
        code = child.wait(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return _report(folder, args, clients, elapsed=elapsed, code=code, rss=rss, state=state,
                   disk_bytes=disk_bytes, num_cancelled=health["queue"]["cancelled"])


def _recorded(store: Any, clients: Clients) -> dict[str, Any]:
    """What the store holds, request by request (by the tag in each step's last message)."""
    steps: dict[str, list[bool]] = {}  # tag -> the `complete` flag of each step with it
    untagged = 0
    for step in store.path(RUN):
        found = re.search(r"\[req -?\d+\.\d+\]", json.dumps(step.content["messages"][-1]))
        if found is None:
            untagged += 1
            continue
        steps.setdefault(found.group(), []).append(step.meta["extra"]["http"]["complete"])
    once = sum(steps.get(t) == [True] for t in clients.delivered)
    return {
        "steps": sum(len(flags) for flags in steps.values()) + untagged,
        "delivered_recorded_once_complete": once,
        "delivered_not_recorded_once": len(clients.delivered) - once,
        "undelivered_recorded_complete": sum(
            True in steps.get(t, []) for t in clients.abandoned),
        "undelivered_recorded_incomplete": sum(
            False in steps.get(t, []) for t in clients.abandoned),
        "dropped_streams_recorded": {
            "complete": sum(steps.get(t) == [True] for t in clients.dropped),
            "incomplete": sum(steps.get(t) == [False] for t in clients.dropped),
            "not_once": sum(len(steps.get(t, [])) != 1 for t in clients.dropped),
        },
        "unknown_steps": untagged + sum(
            len(flags) for t, flags in steps.items()
            if t not in clients.delivered | clients.abandoned | clients.dropped),
    }


def _report(folder: Path, args: argparse.Namespace, clients: Clients, *, elapsed: float,
            code: int, rss: RssSampler, state: dict[str, int], disk_bytes: int,
            num_cancelled: int) -> dict[str, Any]:
    from kvtrace import open_store

    with open_store(f"sqlite:///{folder / 'store.db'}") as store:
        fsck = store.fsck()
        recorded = _recorded(store, clients)
    served = len(clients.latencies)
    latencies = sorted(clients.latencies)
    budget = rss_budget(args.memory_mib, args.other_mib, state)
    growth = (rss.end - rss.start) / 2**20
    is_rss_ok = growth <= budget["total"]
    report = {
        "command": f"scripts/soak.py --clients {args.clients} --seconds {args.seconds:g}"
                   + (f" --model {args.model}" if args.model else ""),
        "model": clients.model, "clients": args.clients, "seconds": round(elapsed, 1),
        "requests_served": served, "requests_by_kind": clients.kinds,
        "streams_completed": clients.num_streamed_done,
        "requests_per_s": round(served / elapsed, 2),
        "errors": len(clients.errors), "first_errors": clients.errors[:5],
        "latency_s": {
            "p50": round(statistics.median(latencies), 3) if latencies else None,
            "p95": round(latencies[int(0.95 * (len(latencies) - 1))], 3) if latencies else None,
            "max": round(latencies[-1], 3) if latencies else None,
        },
        "requests_abandoned": len(clients.abandoned), "streams_dropped": len(clients.dropped),
        "cancelled_by_the_server": num_cancelled,
        "recorded": recorded,
        "server_rss_mib": {"start": round(rss.start / 2**20, 1), "end": round(rss.end / 2**20, 1),
                           "peak": round(rss.peak / 2**20, 1), "growth": round(growth, 1),
                           "series": [round(x / 2**20, 1) for x in rss.series]},
        "rss_growth_budget_mib": budget, "server_state": state,
        "rss_growth_within_budget": is_rss_ok,
        "kv_disk_mib": round(disk_bytes / 2**20, 1), "kv_disk_budget_mib": args.disk_mib,
        "server_exit_code": code,
        "fsck": fsck.to_dict(),
    }
    report["ok"] = (not clients.errors and served > 0
                    and recorded["delivered_not_recorded_once"] == 0
                    and recorded["undelivered_recorded_complete"] == 0
                    and recorded["dropped_streams_recorded"]["not_once"] == 0
                    and recorded["unknown_steps"] == 0
                    and fsck.is_ok and is_rss_ok and disk_bytes <= args.disk_mib * 2**20
                    and code == 0)
    return report


if __name__ == "__main__":
    sys.exit(main())
