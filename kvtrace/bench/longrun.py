"""Long-run benchmark: one conversation of 1,000 and of 10,000 turns through the CLI.

The target: `import`, `log`, `report` and `export` are linear in a
run's length, so a 10,000-turn conversation takes at most 10x the time of a
1,000-turn one, in memory that grows no faster. Each operation runs as its
own `python -m kvtrace` process (a user's command, with its start-up), timed
from the outside: wall time, CPU time and peak RSS (`os.wait4`'s rusage of
that one child). The figures are medians over rounds; `growth` divides the
largest size's by the smallest's.

`trees` names source trees to compare (folders holding a `kvtrace`
package, e.g. a worktree of an older commit): each operation runs in every
tree in turn before the next, so machine noise hits all of them alike, and
the read operations of one round all read the store the round's first
finished import wrote (same rows in every tree: ids do not depend on the
code). A process that passes `timeout_s` or `max_rss_mb` is stopped and
reported as such; a tree whose operation was stopped at one size does not
run it at larger ones.

The conversation is tau-bench / coding-agent shaped (`long_conversation`):
a policy as system prompt, a task, then turns that call a tool (shell
commands, file reads, reservation lookups) and get results of 150 B to
4 KB, with a text answer and a user reply every seventh turn.
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrace.bench.conversations import TOOLS
from kvtrace.errors import UsageError

TIME_RATIO_TARGET = 10.0  # at most 10x the time for 10x the turns
RSS_RATIO_TARGET = 10.0  # memory grows no faster than the run
TARGET_OPS = ("import", "log", "report", "export")
RUN = "long"
FIRST_PAGE = 20
_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class Measure:
    """One operation in one process."""

    wall_s: float
    cpu_s: float
    rss_mb: float
    is_stopped: bool  # passed the time or memory limit
    failed: str | None  # the last line of stderr of a process that failed otherwise


def long_conversation(num_turns: int, *, seed: int = 0) -> dict[str, Any]:
    """An OpenAI chat document of `num_turns` model calls (see the module docstring)."""
    rng = random.Random(seed)
    policy = "".join(f"- Rule {i}: {rng.choice(['economy', 'business'])} fares "
                     f"{rng.choice(['can', 'cannot'])} be changed within {rng.randint(1, 48)} "
                     "hours; confirm every change with the user first.\n" for i in range(60))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful agent working in a repository and "
                                      "an airline's booking system.\n" + policy},
        {"role": "user", "content": "The tests in tests/test_core.py fail since the last "
                                    "change; find out why, fix it, and rebook reservation "
                                    "ZFA04Y to a later flight."},
    ]
    for turn in range(num_turns):
        if turn % 7 == 6:
            messages.append({"role": "assistant", "content": (
                f"Turn {turn}: I changed {rng.randint(1, 4)} files and the failing test "
                "passes now. " + "The remaining failures look unrelated; " * rng.randint(1, 8)
                + "shall I go on?")})
            messages.append({"role": "user", "content": rng.choice(
                ["yes, go on", "Yes. Also check the flaky test.", "No: revert the last edit."])})
            continue
        name, arguments, result = _tool_use(rng, turn)
        call_id = f"call_{turn:05d}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return {"model": "gpt-4o-2024-08-06", "tools": TOOLS, "messages": messages}


def _tool_use(rng: random.Random, turn: int) -> tuple[str, dict[str, Any], str]:
    """A tool call and a result of 150 B to 4 KB."""
    if turn % 3 == 0:
        reservation = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(6))
        return "get_reservation_details", {"reservation_id": reservation}, json.dumps({
            "reservation_id": reservation, "user_id": f"user_{rng.randint(1000, 9999)}",
            "flights": [{"origin": "SFO", "destination": "JFK", "price": rng.randint(80, 900),
                         "date": f"2024-05-{rng.randint(10, 28)}",
                         "flight_number": f"HAT{rng.randint(100, 999)}"}
                        for _ in range(rng.randint(1, 6))]})
    path = rng.choice(["src/core.py", "src/utils.py", "tests/test_core.py", "README.md"])
    lines = "\n".join(f"{n:4d}  def handler_{n}(x):  # returns x + {rng.randint(1, 99)}"
                      for n in range(rng.randint(3, 80)))
    return "bash", {"command": f"nl -ba {path} | sed -n {turn},{turn + 40}p"}, (
        f"<returncode>0</returncode>\n<output>\n{lines}\n</output>")


def run_long_bench(*, turns: tuple[int, ...] = (1000, 10000), trees: tuple[str, ...] = (),
                   rounds: int = 1, timeout_s: float = 600.0,
                   max_rss_mb: float = 6000.0) -> dict[str, Any]:
    """Time each operation at each size in each tree (see the module docstring)."""
    if rounds < 1 or len(turns) < 2 or min(turns) < 1:
        raise UsageError("the long-run benchmark needs two sizes or more and 1 round or more")
    sizes = sorted(set(turns))
    roots = {Path(tree).resolve().name or str(tree): str(Path(tree).resolve())
             for tree in trees} or {"this": str(Path(__file__).resolve().parents[2])}
    for root in roots.values():
        if not (Path(root) / "kvtrace" / "__init__.py").is_file():
            raise UsageError(f"{root} holds no kvtrace package: name a source tree")
    runs: dict[str, dict[str, dict[int, list[Measure]]]] = {
        label: {} for label in roots}
    stopped: dict[tuple[str, str], int] = {}  # (tree, op) -> the size it was stopped at
    with tempfile.TemporaryDirectory(prefix="kvtrace-long-") as tmp:
        work = Path(tmp)
        documents, info = {}, {}
        for n in sizes:
            document = long_conversation(n)
            documents[n] = work / f"conversation-{n}.json"
            documents[n].write_text(json.dumps(document), encoding="utf-8")
            encoded = [len(json.dumps(m).encode()) for m in document["messages"]]
            info[n] = {"messages": len(encoded), "bytes": documents[n].stat().st_size,
                       "largest_message_bytes": max(encoded)}
        order = list(roots)
        for number in range(rounds):
            for n in sizes:
                stores: dict[str, str] = {}
                for label in order:
                    url = f"sqlite:///{work / f'{label}-{n}-{number}.db'}"
                    measure = _op(runs, stopped, label, roots[label], "import", n, work, [
                        "--store", url, "import", "-f", "openai", str(documents[n]),
                        "--run", RUN], timeout_s, max_rss_mb)
                    if measure is not None and not measure.is_stopped and not measure.failed:
                        stores.setdefault("read", url)
                if "read" not in stores:
                    continue  # no tree imported this size: nothing to read
                for op, args in _read_ops(stores["read"], work, n):
                    for label in order:
                        _op(runs, stopped, label, roots[label], op, n, work, args, timeout_s,
                            max_rss_mb)
            order.reverse()  # the next round starts with the other tree
    return _figures(sizes, roots, runs, info)


def _read_ops(url: str, work: Path, n: int) -> list[tuple[str, list[str]]]:
    store = ["--store", url]
    return [
        ("log_first_page", [*store, "log", RUN, "-n", str(FIRST_PAGE)]),
        ("log", [*store, "log", RUN]),
        ("report", [*store, "report", RUN, "--no-tokens", "-o", str(work / f"r{n}.html"),
                    "--force"]),
        ("export", [*store, "export", "-f", "openai", RUN, "-o", str(work / f"e{n}.json"),
                    "--force"]),
    ]


def _op(runs: dict[str, dict[str, dict[int, list[Measure]]]],
        stopped: dict[tuple[str, str], int], label: str, root: str, op: str, n: int,
        work: Path, args: list[str], timeout_s: float, max_rss_mb: float) -> Measure | None:
    """Run one operation unless it was stopped at a smaller size; keep its measure."""
    if (label, op) in stopped:
        return None
    measure = _measure(root, args, work, timeout_s, max_rss_mb)
    runs[label].setdefault(op, {}).setdefault(n, []).append(measure)
    if measure.is_stopped:
        stopped[(label, op)] = n
    return measure


def _measure(root: str, args: list[str], cwd: Path, timeout_s: float,
             max_rss_mb: float) -> Measure:
    """One `python -m kvtrace ARGS` in source tree `root`: wall, CPU, peak RSS."""
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    limit = int(max_rss_mb * 1024 * 1024)

    def cap_memory() -> None:  # in the child: past the cap, allocation fails (MemoryError)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    with tempfile.TemporaryFile(dir=cwd) as errors:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "kvtrace", *args], cwd=cwd, env=env,
                                stdout=subprocess.DEVNULL, stderr=errors,
                                preexec_fn=cap_memory)
        is_stopped = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout_s:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                is_stopped = True
                break
            time.sleep(_POLL_S)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        errors.seek(0)
        tail = errors.read().decode("utf-8", "replace").strip().splitlines()
    failed = None
    if proc.returncode != 0 and not is_stopped:
        failed = tail[-1] if tail else f"exit {proc.returncode}"
        is_stopped = "MemoryError" in failed
    return Measure(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
                   is_stopped, failed)


def _figures(sizes: list[int], roots: dict[str, str],
             runs: dict[str, dict[str, dict[int, list[Measure]]]],
             documents: dict[int, dict[str, int]]) -> dict[str, Any]:
    small, large = sizes[0], sizes[-1]
    results: dict[str, Any] = {}
    growth: dict[str, Any] = {}
    targets: dict[str, bool] = {}
    for label in roots:
        results[label] = {}
        growth[label] = {}
        for op, by_size in runs[label].items():
            results[label][op] = {str(n): _summary(measures) for n, measures in by_size.items()}
            first, last = results[label][op].get(str(small)), results[label][op].get(str(large))
            growth[label][op] = {
                "time_ratio": _ratio(last, first, "wall_s"),
                "cpu_ratio": _ratio(last, first, "cpu_s"),
                "rss_ratio": _ratio(last, first, "rss_mb"),
            }
        targets[label] = all(
            (growth[label].get(op) or {}).get("time_ratio") is not None
            and growth[label][op]["time_ratio"] <= TIME_RATIO_TARGET
            and growth[label][op]["rss_ratio"] <= RSS_RATIO_TARGET
            for op in TARGET_OPS)
    return {
        "turns": sizes,
        "trees": roots,
        "conversations": {str(n): info for n, info in documents.items()},
        "results": results,
        "growth": growth,
        "targets": {"time_ratio_max": TIME_RATIO_TARGET, "rss_ratio_max": RSS_RATIO_TARGET,
                    "ops": list(TARGET_OPS)},
        "targets_met": targets[list(roots)[-1]],  # the last tree named: the one measured
        "targets_met_by_tree": targets,
    }


def _summary(measures: list[Measure]) -> dict[str, Any]:
    done = [m for m in measures if not m.is_stopped and not m.failed]
    if not done:
        failed = next((m.failed for m in measures if m.failed), None)
        return {"stopped": any(m.is_stopped for m in measures), "failed": failed,
                "wall_s": None, "cpu_s": None, "rss_mb": None,
                "limit_s": round(max(m.wall_s for m in measures), 1)}
    return {
        "wall_s": round(statistics.median(m.wall_s for m in done), 3),
        "cpu_s": round(statistics.median(m.cpu_s for m in done), 3),
        "rss_mb": round(statistics.median(m.rss_mb for m in done), 1),
        "num_runs": len(done),
    }


def _ratio(last: dict[str, Any] | None, first: dict[str, Any] | None, key: str) -> float | None:
    if not last or not first or last.get(key) is None or not first.get(key):
        return None
    return round(last[key] / first[key], 2)
