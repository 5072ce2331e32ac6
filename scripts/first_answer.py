"""Seconds from starting `kvtrace serve` to its first chat answer, in fresh processes.

Why: what a user waits before the first token is the process's start (imports,
the load, its probes, the first forward), which in-process benchmarks load
once and never time. Each trial starts `python -m kvtrace serve` on a free
port with an empty store, posts one short chat request (4 tokens, greedy)
until it is answered, prints the seconds, and stops the server. The KV
cache folder is the user's (so a trial after the first may hit the prompt's
KV, as a user's second start would); `--repo` runs another checkout's
kvtrace with this interpreter, for a before/after in turn.

Usage: .venv/bin/python scripts/first_answer.py [--trials N] [--repo PATH] [--model M]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

BODY = {"model": "any", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
        "temperature": 0}


def first_answer_s(repo: str, model: str | None) -> float:
    """One fresh `kvtrace serve`: seconds from its start to the first 200 answer."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "PYTHONPATH": repo, "KVTRACE_HOME": home}
        command = [sys.executable, "-m", "kvtrace", "serve", "--port", str(port),
                   *(["--model", model] if model else [])]
        start = time.monotonic()
        server = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        try:
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"kvtrace serve ended: {server.communicate()[1][-2000:]}")
                try:
                    reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                       json=BODY, timeout=300)
                    if reply.status_code == 200:
                        return time.monotonic() - start
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        finally:
            server.terminate()
            server.communicate(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--repo", default=os.getcwd(), help="the checkout whose kvtrace runs")
    parser.add_argument("--model", default=None, help="default: the embedded model")
    args = parser.parse_args()
    seconds = [first_answer_s(args.repo, args.model) for _ in range(args.trials)]
    print(" ".join(f"{s:.2f}" for s in seconds), f"median {statistics.median(seconds):.2f} s")


if __name__ == "__main__":
    main()
