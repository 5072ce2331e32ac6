"""The public surface of kvtrace.replay is explicit and pinned; importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import kvtrace.replay


def test_public_names_are_pinned():
    assert sorted(kvtrace.replay.__all__) == sorted([
        "Analysis", "Backend", "BranchReport", "ContinueResult", "LocalBackend", "PrefixBreaker",
        "RemoteBackend", "ReplayMode", "ReplayReport", "RetryPolicy", "RunOutcome", "RunStatus",
        "RunsReport", "SamplingParams", "StepReport", "analyze", "branch_out", "checkout",
        "continue_run", "open_local_backend", "replay", "replay_runs", "select_runs",
    ])
    for name in kvtrace.replay.__all__:
        assert hasattr(kvtrace.replay, name), name


def test_importing_replay_does_not_load_torch():
    code = "import sys, kvtrace.replay; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
