"""Store stress: concurrent and SIGKILLed writer processes on a real database.

A writer is a separate process (`python -m kvtrace.bench.stress writer ...`)
that appends steps and prints `ok <step id>`, flushed, the moment each append
returns: the parent's record of what the store promised. A ConflictError is
printed as `conflict` (the writer refreshes its run and tries the same step
again); any other exception as `error <type>: <message>`, and the writer
stops. The scenarios:

- `run_writers`: W writers x N appends at once, each to its own run or all to
  one run; with `swap_blobs`, pairs of writers record the same two blobs in
  opposite orders (writer A `("X{i}", "Y{i}")`, writer B `("Y{i}", "X{i}")`),
  in lock step, the shape that once deadlocked PostgreSQL;
- `run_kills`: K rounds of W writers on one run, each round SIGKILLed at a
  random moment while appending.

`verify` then checks what must hold: every promised step is on its run's
chain exactly once, fsck is clean (SQLite: `PRAGMA integrity_check` too), and
no writer saw an error other than the documented ConflictError. Tests run
these with short settings; `python -m kvtrace.bench.stress URL` runs the long
ones (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any

from kvtrace.errors import ConflictError, KvtraceError
from kvtrace.store import open_store


@dataclass(slots=True)
class Outcome:
    """What the writers reported, by run: promised step ids, conflicts, errors."""

    promised: dict[str, list[str]] = field(default_factory=dict)
    num_conflicts: int = 0
    errors: list[str] = field(default_factory=list)
    num_kills: int = 0

    def take(self, run: str, line: str) -> None:
        """Record one line of a writer's output (a cut-off last line is ignored)."""
        if line.startswith("ok ") and len(line) == 3 + 64:
            self.promised.setdefault(run, []).append(line[3:])
        elif line == "conflict":
            self.num_conflicts += 1
        elif line.startswith("error "):
            self.errors.append(line[6:])

    @property
    def num_appends(self) -> int:
        return sum(len(ids) for ids in self.promised.values())


# -- the writer process ----------------------------------------------------------------


def writer(
    url: str, run_name: str, num_steps: int, tag: str, *, blobs: str, lockstep: bool
) -> int:
    """Append `num_steps` steps to `run_name`, reporting each on stdout (see module doc).

    `blobs` is "own" (payloads unique to this writer), "xy" or "yx" (the shared
    blobs "X{i}" and "Y{i}" as arguments and result, in that order).
    """
    store = open_store(url)
    run = store.run(run_name)
    i = 0
    is_retry = False
    while i < num_steps:
        if lockstep and not is_retry and not sys.stdin.readline():
            break
        is_retry = False
        arguments: Any = {"tag": tag, "i": i}
        result: Any = i
        if blobs != "own":
            arguments, result = (f"X{i}", f"Y{i}") if blobs == "xy" else (f"Y{i}", f"X{i}")
        try:
            step = run.record_tool_call("t", arguments, result)
        except ConflictError:
            print("conflict", flush=True)
            run.refresh()
            is_retry = True
            continue
        except Exception as exc:  # reported, not raised: the parent counts every kind
            print(f"error {type(exc).__name__}: {' '.join(str(exc).split())}", flush=True)
            return 1
        print(f"ok {step.id}", flush=True)
        i += 1
    store.close()
    return 0


def _spawn(url: str, run: str, num_steps: int, tag: str, *, blobs: str = "own",
           lockstep: bool = False) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "kvtrace.bench.stress", "writer", url, run, str(num_steps), tag]
    args += ["--blobs", blobs]
    args += ["--lockstep"] if lockstep else []
    return subprocess.Popen(
        args, stdin=subprocess.PIPE if lockstep else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _collect(outcome: Outcome, run: str, process: subprocess.Popen[str]) -> None:
    out, err = process.communicate()
    lines = out.split("\n")
    for line in lines[:-1] if not out.endswith("\n") else lines:
        outcome.take(run, line)
    if process.returncode not in (0, 1, -signal.SIGKILL):
        outcome.errors.append(f"writer exited {process.returncode}: {err.strip()[-300:]}")


# -- scenarios ---------------------------------------------------------------------------


def run_writers(
    url: str, *, num_writers: int, num_steps: int, shared_run: bool = False,
    swap_blobs: bool = False,
) -> Outcome:
    """W writer processes x N appends at once (see module doc)."""
    outcome = Outcome()
    runs = ["shared" if shared_run else f"w{w}" for w in range(num_writers)]
    open_store(url).close()  # migrate once, before the writers race to open it
    lockstep = swap_blobs
    processes = [
        _spawn(url, runs[w], num_steps, f"w{w}", lockstep=lockstep,
               blobs=("yx" if w % 2 else "xy") if swap_blobs else "own")
        for w in range(num_writers)
    ]
    if lockstep:  # one step at a time for everyone: release all, wait for all
        alive = list(range(num_writers))
        for _ in range(num_steps):
            for w in alive:
                stdin = processes[w].stdin
                assert stdin is not None
                stdin.write("\n")
                stdin.flush()
            for w in list(alive):
                stdout = processes[w].stdout
                assert stdout is not None
                line = "conflict"
                while line == "conflict":
                    line = stdout.readline().rstrip("\n")
                    outcome.take(runs[w], line)
                if not line.startswith("ok "):  # the writer stopped (an error, or it died)
                    alive.remove(w)
    for w, process in enumerate(processes):
        _collect(outcome, runs[w], process)  # closes stdin: a lock-step writer then stops
    return outcome


def run_kills(
    url: str, *, num_rounds: int, num_writers: int = 2, max_alive_s: float = 1.0,
    seed: int = 0,
) -> Outcome:
    """K rounds of W writers on one run, each round SIGKILLed at a random moment."""
    rng = random.Random(seed)
    outcome = Outcome()
    open_store(url).close()
    for round_number in range(num_rounds):
        processes = [
            _spawn(url, "killed", 1_000_000, f"r{round_number}w{w}")
            for w in range(num_writers)
        ]
        try:
            for process in processes:  # wait until each has appended at least once
                _await_first_append(process, outcome)
            time.sleep(rng.uniform(0.0, max_alive_s))
        finally:  # never leave an endless writer behind, whatever happened here
            for process in processes:
                process.send_signal(signal.SIGKILL)
                outcome.num_kills += 1
        for process in processes:
            _collect(outcome, "killed", process)
    return outcome


def _await_first_append(process: subprocess.Popen[str], outcome: Outcome) -> None:
    assert process.stdout is not None
    while True:
        line = process.stdout.readline()
        if not line:
            return
        outcome.take("killed", line.rstrip("\n"))
        if line.startswith(("ok ", "error ")):
            return


# -- checks --------------------------------------------------------------------------------


def verify(url: str, outcome: Outcome) -> list[str]:
    """What broke a promise (empty when the store kept every one)."""
    problems = list(outcome.errors)
    with open_store(url, create=False) as store:
        for run, ids in outcome.promised.items():
            chain = [step.id for step in store.log(run)]
            counts = Counter(chain)
            lost = [i for i in ids if counts[i] != 1]
            if lost:
                problems.append(f"run {run}: {len(lost)} promised steps not on its chain once")
        problems.extend(store.fsck().problems)
        if store.engine.dialect.name == "sqlite":
            with store.engine.connect() as conn:
                check = conn.exec_driver_sql("PRAGMA integrity_check").scalar()
            if check != "ok":
                problems.append(f"sqlite integrity_check: {check}")
    return problems


# -- entry point ---------------------------------------------------------------------------


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtrace.bench.stress")
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("writer")
    one.add_argument("url")
    one.add_argument("run")
    one.add_argument("num_steps", type=int)
    one.add_argument("tag")
    one.add_argument("--blobs", choices=["own", "xy", "yx"], default="own")
    one.add_argument("--lockstep", action="store_true")
    long = sub.add_parser("all", help="the long settings, one JSON object per scenario")
    long.add_argument("url", help="a store URL for a new, empty store")
    long.add_argument("--writers", type=int, default=8)
    long.add_argument("--appends", type=int, default=500)
    long.add_argument("--kills", type=int, default=20)
    args = parser.parse_args(argv)
    if args.command == "writer":
        return writer(args.url, args.run, args.num_steps, args.tag, blobs=args.blobs,
                      lockstep=args.lockstep)
    if args.command == "all":
        return _long(args.url, args.writers, args.appends, args.kills, sys.stdout)
    parser.print_help()
    return 2


def _long(url: str, num_writers: int, num_appends: int, num_kills: int, out: IO[str]) -> int:
    """Every scenario at long settings on the store at `url`; exit 1 on any broken promise."""
    scenarios: dict[str, Any] = {
        "own_runs": lambda: run_writers(url, num_writers=num_writers, num_steps=num_appends),
        "one_run": lambda: run_writers(
            url, num_writers=max(2, num_writers - 2), num_steps=num_appends // 5,
            shared_run=True,
        ),
        "swapped_blobs": lambda: run_writers(
            url, num_writers=2, num_steps=num_appends, swap_blobs=True
        ),
        "kills": lambda: run_kills(url, num_rounds=num_kills),
    }
    failed = False
    for name, scenario in scenarios.items():
        started = time.perf_counter()
        outcome = scenario()
        problems = verify(url, outcome)
        failed = failed or bool(problems)
        out.write(json.dumps({
            "scenario": name, "seconds": round(time.perf_counter() - started, 1),
            "appends": outcome.num_appends, "conflicts": outcome.num_conflicts,
            "kills": outcome.num_kills, "problems": problems[:20],
        }) + "\n")
        out.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(_main(sys.argv[1:]))
    except KvtraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
