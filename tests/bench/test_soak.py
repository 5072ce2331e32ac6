"""scripts/soak.py in short: 3 clients for 4 seconds against a real server process, tiny model,
with clients that give up on long answers and drop streams among them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def test_a_short_soak_records_each_delivered_answer_once_and_no_undelivered_one_as_complete():
    done = subprocess.run([sys.executable, str(SOAK), "--clients", "3", "--seconds", "4",
                           "--model", "tiny"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["errors"] == 0 and report["requests_served"] >= 2
    recorded = report["recorded"]
    assert recorded["delivered_recorded_once_complete"] == report["requests_served"] + 1  # warm-up
    assert recorded["delivered_not_recorded_once"] == 0 and recorded["unknown_steps"] == 0
    # each kind of client ran: 3 clients from turns 0-2 take 6 kinds in their first 2 turns
    assert report["requests_abandoned"] >= 1 and report["streams_dropped"] >= 1
    assert recorded["undelivered_recorded_complete"] == 0
    assert 1 <= report["cancelled_by_the_server"] <= report["requests_abandoned"]
    assert recorded["dropped_streams_recorded"]["not_once"] == 0
    assert report["streams_completed"] == report["requests_by_kind"].get("stream", 0)
    assert report["fsck"]["ok"] and report["fsck"]["problems"] == []
    assert report["rss_growth_within_budget"] and report["server_exit_code"] == 0
