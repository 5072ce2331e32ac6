"""A disk tier at its budget says what it evicted (issue 41, item 6).

`$KVTRACE_KV_DISK_MAX` (or `KVCache(disk_bytes=...)`) bounds the KV folder:
past it, the least recently used tail blocks are evicted. Each eviction is
logged beside the failed writes (the closing line of replay, record and
serve says it) and counted on disk for `kvtrace cache stats` in any later
process; a budget that is no size is refused in one line before anything
loads.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.engine import KVCache, prefill
from kvtrace.engine.faults import disk_faults_lines, read_disk_record
from kvtrace.engine.maintenance import cache_stats
from kvtrace.errors import UsageError
from kvtrace.paths import kv_disk_budget

B = 64


def test_evictions_at_the_budget_are_logged_counted_and_shown(tiny_engine, tiny_folder, tokens,
                                                              tmp_path):
    block = B * tiny_engine.kv_bytes_per_token  # one block's keys and values
    kv = tmp_path / "cache" / "kv"
    cache = KVCache(tiny_engine, disk_dir=kv, disk_bytes=3 * block + block // 2)
    for seed in (1, 2, 3):  # two blocks each: six written, a budget of three
        prefill(tiny_engine, cache, tokens(2 * B + 1, seed=seed))
    faults = cache.take_disk_faults()
    assert faults and faults.num_failed_writes == 0
    assert faults.num_evicted_blocks >= 3 and faults.num_evicted_bytes >= 3 * block
    assert faults.disk_budget == 3 * block + block // 2
    assert not cache.take_disk_faults()  # taken once
    left = sorted(kv.rglob("*.safetensors"))
    assert 0 < len(left) <= 3

    [line] = disk_faults_lines(faults)
    assert "reached its budget" in line and "evicted" in line and str(kv) in line
    assert f"{faults.num_evicted_blocks} KV blocks" in line

    record = read_disk_record(kv)
    assert record.num_evicted_blocks == faults.num_evicted_blocks
    assert record.num_failed_writes == 0
    stats = cache_stats(tiny_engine, kv, block_size=B)
    assert stats.num_evicted_blocks == faults.num_evicted_blocks

    shown = CliRunner().invoke(app, ["cache", "stats", "--model", str(tiny_folder),
                                     "--cache-dir", str(tmp_path / "cache")])
    assert shown.exit_code == 0, shown.stdout
    assert f"evicted          {faults.num_evicted_blocks:,} blocks" in shown.stdout


def test_no_eviction_under_the_budget_says_nothing(tiny_engine, tokens, tmp_path):
    cache = KVCache(tiny_engine, disk_dir=tmp_path / "kv", disk_bytes=1 << 30)
    prefill(tiny_engine, cache, tokens(2 * B + 1, seed=4))
    faults = cache.take_disk_faults()
    assert not faults and disk_faults_lines(faults) == []
    assert read_disk_record(tmp_path / "kv").num_evicted_blocks == 0


def test_the_budget_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.delenv("KVTRACE_KV_DISK_MAX", raising=False)
    assert kv_disk_budget() is None
    monkeypatch.setenv("KVTRACE_KV_DISK_MAX", "2GiB")
    assert kv_disk_budget() == 2 * 1024**3
    monkeypatch.setenv("KVTRACE_KV_DISK_MAX", "lots")
    with pytest.raises(UsageError) as refused:
        kv_disk_budget()
    assert "$KVTRACE_KV_DISK_MAX" in str(refused.value) and "'lots'" in str(refused.value)
