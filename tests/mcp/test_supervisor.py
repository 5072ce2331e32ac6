"""examples/supervisor.py's scenario with the supervisor as an MCP client, on both backends.

A worker process (tests/mcp/worker.py) appends to run `job`: it asks a
lookup tool about Lima, gets a stale result (population 0) and keeps asking.
The supervisor, speaking only MCP to `kvtrace mcp` over stdio, watches the
run, pauses it, notes the bad step, reverts the run to before it, forks it
with the result fixed, leaves the worker a note naming the fork and resumes
it. The worker's next append conflicts (its head moved), it reads the note
and answers on the fork. Nothing recorded is lost: the bad steps stay
reachable, and the watch saw every move.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from kvtrace.replay.tools import CITY_FACTS
from tests.mcp.conftest import server_env

WORKER = Path(__file__).with_name("worker.py")
HANDOFF = "continue on run "


def _wait_for_run(client, name: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while name not in {r["name"] for r in client.call("list_runs")["runs"]}:
        assert time.monotonic() < deadline, f"the worker never created {name}"
        time.sleep(0.05)


def _first_bad_step(client, name: str, worker: subprocess.Popen) -> tuple[dict, int]:
    """Watch `name` from its start until a lookup says nobody lives in the city."""
    cursor, deadline = 0, time.monotonic() + 60
    while time.monotonic() < deadline:
        assert worker.poll() is None, "the worker ended before anything was fixed"
        watched = client.call("watch", run=name, cursor=cursor, timeout=5)
        for event in watched["events"]:
            step = event["step"]
            if (event["kind"] == "step" and step["kind"] == "tool_call"
                    and step["content"]["result"]["population"] == 0):
                return step, event["cursor"]
        cursor = watched["cursor"]
    raise AssertionError("no bad step seen within 60 s")


def test_a_supervisor_over_mcp_fixes_a_workers_run_and_the_worker_goes_on_on_the_fork(
        client, stores, name, tmp_path):
    fixed = f"{name}-fixed"
    worker = subprocess.Popen([sys.executable, str(WORKER), stores, name], cwd=tmp_path,
                              env=server_env(tmp_path / "cache"), stdout=subprocess.PIPE,
                              text=True)
    try:
        _wait_for_run(client, name)
        bad, seen = _first_bad_step(client, name, worker)

        paused = client.call("pause", run=name, reason="a supervisor is checking a lookup")
        client.call("note", spec=bad["id"], text="bad tool result: population 0",
                    author="supervisor")
        client.call("revert", run=name, to=bad["parent_id"])
        good = {**bad["content"]["result"], "population": CITY_FACTS["lima"]["population"]}
        forked = client.call("fork", spec=bad["id"], new=fixed, edit={"result": good})
        client.call("note", spec=bad["parent_id"], text=HANDOFF + fixed, author="supervisor")
        client.call("resume", run=name, reason="fixed on a fork")

        out, _ = worker.communicate(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, out
    assert f"worker: continuing on {fixed}" in out
    assert f"worker: answered on {fixed}: " in out and "10151200 people" in out

    # The fork: the edited lookup under the bad step's parent, then the worker's answer.
    log = client.call("log", run=fixed)["steps"]
    assert [s["depth"] for s in log[:2]] == [bad["depth"] + 1, bad["depth"]]
    assert len(log) == bad["depth"] + 1  # and below it, the history it shares with the run
    assert log[1]["id"] == forked["head"] and forked["edit_of"] == bad["id"]
    assert log[1]["parent_id"] == bad["parent_id"] and log[1]["content"]["result"] == good
    assert "Lima is in Peru; 10151200 people" in log[0]["content"]["response"]["content"]

    # The original run: reverted to before the bad step, which is kept with its note.
    run = client.call("log", run=name, limit=1)["steps"][0]
    assert run["id"] == bad["parent_id"]
    shown = client.call("show_step", spec=bad["id"])
    assert [n["text"] for n in shown["notes"]] == ["bad tool result: population 0"]
    assert shown["content"]["result"]["population"] == 0

    # The supervisor's own watch saw every move after the bad step, in order.
    moves = client.call("watch", run=name, cursor=paused["id"] - 1, timeout=0)["events"]
    assert [(e["kind"], e["reason"]) for e in moves[:3]] == [
        ("pause", "pause"), ("moved", "revert"), ("resume", "resume")]
    assert moves[1]["is_back"] and moves[1]["head"] == bad["parent_id"]
    assert paused["id"] > seen
