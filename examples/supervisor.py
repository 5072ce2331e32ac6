"""A supervisor steers a worker agent running in another process.

The worker is the demo ReAct agent (SmolLM2-135M-Instruct with a calculator
and a lookup tool), asked which country Lima is in; its lookup tool answers
from a stale table that lost every population (0). The supervisor, in this process:

1. watches the worker's run (`Store.watch`) and spots the bad tool result;
2. pauses the run, notes the step (`Store.note`), and reverts the run to
   before it (`Store.revert`): the bad step stays reachable in the reflog;
3. forks the run with the tool result fixed (`Store.fork(..., edit=...)`) and
   leaves the worker a note on its head naming the fork, then resumes it.

The worker's next append fails with a ConflictError (its head moved), so it
reads the note and continues on the fork, warm: the fork's prompt shares its
whole prefix with what the worker's cache already holds.

    python examples/supervisor.py            # a fresh store in a temporary folder
    python examples/supervisor.py --store sqlite:///.kvtrace/store.db
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtrace import ConflictError, open_store
from kvtrace.replay.tools import CITY_FACTS

QUESTION = "Which country is Lima in?"
HANDOFF = "continue on run "


def stale_lookup(query: Any) -> dict[str, Any] | str:
    """The worker's lookup tool: a stale copy of the table, every population lost."""
    text = str(query.get("city", "")) if isinstance(query, dict) else str(query)
    for city, facts in CITY_FACTS.items():
        if city in text.lower():
            return {"city": city.title(), **facts, "population": 0}
    return f"no facts about {text!r}"


def is_bad(step: Any) -> bool:
    """The supervisor's check: a lookup that reports nobody living in a city."""
    result = step.content.get("result")
    return step.meta.get("tool") == "lookup" and isinstance(result, dict) and (
        result.get("population") == 0)


def worker(url: str, run: str) -> int:
    """The agent: one model call at a time; on a conflict, follow the supervisor's note."""
    from kvtrace.paths import default_cache_dir
    from kvtrace.replay import SamplingParams, continue_run, open_local_backend
    from kvtrace.replay.tools import calculator, demo_messages

    store = open_store(url)
    backend = open_local_backend(None, cache_dir=default_cache_dir(),
                                 kv_dir=Path(tempfile.mkdtemp(prefix="kvtrace-kv-")))
    tools = {"calculator": calculator, "lookup": stale_lookup}
    params = SamplingParams(max_new_tokens=48)
    current, messages, last = run, demo_messages(QUESTION), None
    for _ in range(8):
        try:  # `expected_head`: a run moved since our last step is a conflict
            result = continue_run(store, current, backend, steps=1, tools=tools,
                                  messages=messages, params=params, expected_head=last)
        except ConflictError as exc:
            print(f"worker: {type(exc).__name__}: the supervisor moved {current!r}", flush=True)
            head = store.head(current)
            notes = store.notes(head.id) if head else []
            handoff = [n.text for n in notes if n.text.startswith(HANDOFF)]
            if not handoff:
                raise
            current, messages = handoff[-1][len(HANDOFF):], None
            last = store.head(current).id
            print(f"worker: continuing on {current!r}", flush=True)
            continue
        messages, last = None, result.new_steps[-1].id
        for report in result.reports:
            print(f"worker: {current} @{report.depth}: {report.reused_tokens}/"
                  f"{report.prompt_tokens} prompt tokens reused", flush=True)
        if result.is_finished:
            print(f"worker: final answer on {current!r}: {result.final_answer}", flush=True)
            return 0
    print("worker: no final answer within 8 model calls", flush=True)
    return 0


def supervise(url: str, run: str) -> None:
    """Watch the worker and fix its first bad tool result."""
    store = open_store(url)
    store.run(run)  # created empty, so the watch can start before the worker
    process = subprocess.Popen([sys.executable, __file__, "--worker", "--store", url,
                                "--run", run])
    fixed = f"{run}-fixed"
    try:
        for event in store.watch(run, since=0, timeout=600):
            if event.kind == "step" and event.step is not None:
                step = event.step
                print(f"supervisor: saw @{step.depth} {step.kind} "
                      f"{step.meta.get('tool') or step.meta.get('model', '')}", flush=True)
                if step.kind == "tool_call" and is_bad(step):
                    _fix(store, run, fixed, step)
                    break
            if process.poll() is not None:
                print("supervisor: the worker finished with nothing to fix", flush=True)
                break
        process.wait(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    print(f"\nreflog of {run!r} (the bad step stays reachable):")
    for entry in store.reflog(run):
        print(f"  {entry.reason:7} {str(entry.old_head)[:12]} -> {str(entry.new_head)[:12]}  "
              f"{entry.message}")
    if fixed in {info.name for info in store.runs()}:
        print(f"\nrun {fixed!r}:")
        for step in store.path(fixed):
            print(f"  @{step.depth} {step.kind:10} "
                  f"{'(edited) ' if 'edit_of' in step.meta else ''}"
                  f"{str(step.content.get('result', step.content.get('response', '')))[:70]}")
    store.close()


def _fix(store: Any, run: str, fixed: str, step: Any) -> None:
    store.pause(run, reason="a supervisor is checking a tool result")
    store.note(step.id, f"bad tool result: {step.content['result']}", author="supervisor")
    store.revert(run, to=step.parent_id)
    result = step.content["result"]
    good = {**result, "population": CITY_FACTS[result["city"].lower()]["population"]}
    store.fork(step.id, fixed, edit={"result": good})
    store.note(step.parent_id, f"{HANDOFF}{fixed}", author="supervisor")
    store.resume(run, reason="fixed on a fork")
    print(f"supervisor: paused {run!r}, noted @{step.depth}, reverted it, forked {fixed!r} "
          "with the fix, resumed", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="store URL (default: a new temporary SQLite store)")
    parser.add_argument("--run", default="job", help="the worker's run name")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    url = args.store or f"sqlite:///{Path(tempfile.mkdtemp(prefix='kvtrace-')) / 'store.db'}"
    if args.worker:
        sys.exit(worker(url, args.run))
    print(f"store: {url}")
    supervise(url, args.run)


if __name__ == "__main__":
    main()
