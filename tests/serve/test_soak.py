"""bench/soak.py in short: 2 clients for 3 seconds against a real server process, tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def test_a_short_soak_serves_every_request_records_each_once_and_leaves_fsck_clean():
    done = subprocess.run([sys.executable, str(SOAK), "--clients", "2", "--seconds", "3",
                           "--model", "tiny"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["errors"] == 0 and report["requests_served"] >= 2
    assert report["steps_recorded"] == report["requests_served"]
    assert report["streams_completed"] == report["requests_by_kind"].get("stream", 0)
    assert report["fsck"]["ok"] and report["fsck"]["problems"] == []
    assert report["rss_growth_within_budget"] and report["server_exit_code"] == 0
