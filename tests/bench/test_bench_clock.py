"""kvtrace/bench/clock.py: a trial's wall time split into this process's CPU and everyone else's."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.bench.clock import TrialClock

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux's /proc/stat")

BURN = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"


def test_cpu_time_spent_by_another_process_during_a_trial_is_counted_as_others():
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with TrialClock() as clock:  # this process waits; a child burns half a second of CPU
        subprocess.run([sys.executable, "-c", BURN], check=True)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    burnt = (children.ru_utime - children_before.ru_utime
             + children.ru_stime - children_before.ru_stime)
    figures = clock.figures()
    assert burnt >= 0.5
    assert figures["others_cpu_s"] >= 0.9 * burnt  # the machine's busy time, less ours
    assert figures["cpu_s"] < burnt  # waiting for a child is not this process's CPU
    assert figures["load_start"] is not None and figures["voluntary_switches"] >= 1
