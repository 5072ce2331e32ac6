"""The disk tier's faults never stop a computation and are always shown (issue 23, item 2).

On a real full disk (a tmpfs smaller than one block) and a real read-only
one (a tmpfs remounted read-only), prefill gives the cold result, the write
failures are logged with the OS's reason and counted on disk for
`cache stats`; a damaged block is named with its reason. Mounting needs
root: elsewhere the mount tests skip, saying so (tests/mounts.py).
"""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.engine import KVCache, prefill
from kvtrace.engine.disk import BlockStore
from kvtrace.engine.faults import BlockFault, read_disk_record
from kvtrace.engine.maintenance import cache_stats
from kvtrace.errors import BlockWriteError
from tests.mounts import fill, make_read_only, tmpfs

B = 64
ENOSPC = "No space left on device"
EROFS = "Read-only file system"


def _assert_cold(engine, hot, prompt):
    cold = prefill(engine, None, prompt)
    assert torch.equal(hot.logits, cold.logits)


def test_a_full_disk_fails_block_writes_but_not_the_prefill(tiny_engine, tokens, tmp_path):
    prompt = tokens(3 * B + 5, seed=80)
    with tmpfs(tmp_path / "small", size="64k") as mount:  # a block is 128 KiB
        cache = KVCache(tiny_engine, disk_dir=mount / "kv")
        hot = prefill(tiny_engine, cache, prompt)
        _assert_cold(tiny_engine, hot, prompt)
        faults = cache.take_disk_faults()
        # the first block fails; its children are not attempted (they would be unreachable)
        assert (faults.num_failed_writes, faults.write_reasons) == (1, (ENOSPC,))
        assert faults.folder == str(mount / "kv") and faults.num_damaged == 0
        assert not cache.take_disk_faults()  # taken once
        assert not list((mount / "kv").rglob("*.safetensors"))  # no temporary file left
        assert read_disk_record(mount / "kv").num_failed_writes == 1


def test_a_failed_write_raises_block_write_error_and_leaves_no_temporary_file(
    tiny_engine, tokens, tmp_path
):
    prompt = tokens(B, seed=81)
    with tmpfs(tmp_path / "small", size="64k") as mount:
        store = BlockStore(mount / "kv", block_size=B)
        key = store.chain_keys(tiny_engine.fingerprint, prompt)[0]
        keys, values = torch.zeros(2, 2, B, 64), torch.ones(2, 2, B, 64)
        try:
            store.write(key, store.root_key(tiny_engine.fingerprint), tiny_engine.fingerprint,
                        prompt, keys, values)
        except BlockWriteError as exc:
            assert ENOSPC in str(exc) and key[:16] in str(exc)
        else:
            raise AssertionError("a block larger than the disk was written")
        assert [p.name for p in (mount / "kv").rglob("*") if p.is_file()] == [
            "write-failures.json"
        ]


def test_a_read_only_disk_serves_its_blocks_and_fails_new_writes(tiny_engine, tokens, tmp_path):
    prompt = tokens(3 * B + 5, seed=82)
    with tmpfs(tmp_path / "ro", size="1m") as mount:
        prefill(tiny_engine, KVCache(tiny_engine, disk_dir=mount / "kv"), prompt[: 2 * B + 1])
        make_read_only(mount)
        cache = KVCache(tiny_engine, disk_dir=mount / "kv")
        hot = prefill(tiny_engine, cache, prompt)
        assert hot.num_disk_tokens == 2 * B
        _assert_cold(tiny_engine, hot, prompt)
        faults = cache.take_disk_faults()
        assert (faults.num_failed_writes, faults.write_reasons) == (1, (EROFS,))


def test_a_damaged_block_on_a_read_only_disk_is_a_miss_named_in_the_faults(
    tiny_engine, tokens, tmp_path
):
    prompt = tokens(2 * B + 5, seed=83)
    with tmpfs(tmp_path / "ro", size="1m") as mount:
        writer = KVCache(tiny_engine, disk_dir=mount / "kv")
        prefill(tiny_engine, writer, prompt)
        key = writer.disk.chain_keys(tiny_engine.fingerprint, prompt)[0]
        writer.disk.path(key).write_bytes(b"not a block")
        make_read_only(mount)
        cache = KVCache(tiny_engine, disk_dir=mount / "kv")
        hot = prefill(tiny_engine, cache, prompt)  # cannot delete it: a miss all the same
        assert hot.num_disk_tokens == 0
        _assert_cold(tiny_engine, hot, prompt)
        faults = cache.take_disk_faults()
        assert [(fault.key, fault.is_deleted) for fault in faults.damaged] == [(key, False)]
        assert writer.disk.path(key).read_bytes() == b"not a block"  # could not be deleted


def test_a_damaged_block_is_named_with_its_reason_and_recomputed(
    tiny_engine, tokens, make_cache, kv_dir
):
    prompt = tokens(3 * B + 5, seed=84)
    prefill(tiny_engine, make_cache(tiny_engine), prompt)
    store = BlockStore(kv_dir, block_size=B)
    key = store.chain_keys(tiny_engine.fingerprint, prompt)[1]
    raw = bytearray(store.path(key).read_bytes())
    raw[-100] ^= 1  # one bit of the KV
    store.path(key).write_bytes(bytes(raw))

    cache = make_cache(tiny_engine)
    hot = prefill(tiny_engine, cache, prompt)
    assert hot.num_disk_tokens == B
    _assert_cold(tiny_engine, hot, prompt)
    faults = cache.take_disk_faults()
    assert faults.damaged == (
        BlockFault(key, "checksum mismatch: its bytes changed after it was written"),
    )
    assert faults.num_failed_writes == 0 and store.path(key).is_file()  # rewritten


def test_a_write_behind_failure_is_logged_with_its_reason(tiny_engine, tokens, tmp_path):
    prompt = tokens(3 * B + 5, seed=85)
    with tmpfs(tmp_path / "small", size="64k") as mount:
        cache = KVCache(tiny_engine, disk_dir=mount / "kv", write_behind=True)
        hot = prefill(tiny_engine, cache, prompt)
        cache.flush()
        _assert_cold(tiny_engine, hot, prompt)
        faults = cache.take_disk_faults()
        assert (faults.num_failed_writes, faults.write_reasons) == (1, (ENOSPC,))
        assert not list((mount / "kv").rglob("*.safetensors"))


def test_cache_stats_count_failed_writes_and_say_why_writes_fail(
    tiny_engine, tiny_folder, tokens, tmp_path
):
    with tmpfs(tmp_path / "cache", size="1m") as root:
        kv = root / "kv"
        prefill(tiny_engine, KVCache(tiny_engine, disk_dir=kv), tokens(2 * B + 1, seed=86))
        fill(root, leave=16 * 1024)  # room for the counter, not for a block
        cache = KVCache(tiny_engine, disk_dir=kv)
        prefill(tiny_engine, cache, tokens(2 * B + 1, seed=87))
        prefill(tiny_engine, cache, tokens(2 * B + 1, seed=88))
        stats = cache_stats(tiny_engine, kv, block_size=B)
        assert (stats.num_failed_writes, stats.last_failed_write) == (2, ENOSPC)
        assert stats.is_disk_writable and stats.disk_free_bytes is not None
        assert stats.disk_free_bytes < B * tiny_engine.kv_bytes_per_token

        args = ["cache", "stats", "--model", str(tiny_folder), "--cache-dir", str(root)]
        shown = CliRunner().invoke(app, args)
        assert shown.exit_code == 0, shown.stdout
        assert f"failed writes    2 (last: {ENOSPC})" in shown.stdout
        assert "no block can be written" in shown.stdout

        make_read_only(root)
        assert not cache_stats(tiny_engine, kv, block_size=B).is_disk_writable
        shown = CliRunner().invoke(app, args)
        assert "read-only: no block can be written" in shown.stdout


def test_the_count_survives_a_disk_that_fills_up_after_the_first_block(
    tiny_engine, tokens, tmp_path
):
    """Issue 41, item 6: the record was made while there was room, and a full disk still takes
    its update in place (it was left empty before)."""
    from kvtrace.engine.faults import WRITE_FAILURES_FILE, fallback_path

    with tmpfs(tmp_path / "cache", size="1m") as root:
        kv = root / "kv"
        prefill(tiny_engine, KVCache(tiny_engine, disk_dir=kv), tokens(2 * B + 1, seed=90))
        fill(root, leave=0)  # not one page left
        cache = KVCache(tiny_engine, disk_dir=kv)
        for seed in (91, 92, 93):
            prefill(tiny_engine, cache, tokens(2 * B + 1, seed=seed))
        faults = cache.take_disk_faults()
        assert (faults.num_failed_writes, faults.num_uncounted) == (3, 0)
        assert read_disk_record(kv).num_failed_writes == 3
        assert (kv / WRITE_FAILURES_FILE).stat().st_size > 0
        assert not fallback_path(kv).exists()


def test_a_disk_full_before_any_record_counts_in_the_fallback_and_stats_add_it(
    tiny_engine, tokens, tmp_path
):
    from kvtrace.engine.faults import fallback_path

    with tmpfs(tmp_path / "cache", size="64k") as root:
        kv = root / "kv"
        kv.mkdir()
        fill(root, leave=0)
        try:
            cache = KVCache(tiny_engine, disk_dir=kv)
            prefill(tiny_engine, cache, tokens(2 * B + 1, seed=94))
            faults = cache.take_disk_faults()
            assert faults.num_failed_writes == 1 and faults.num_uncounted == 0
            assert read_disk_record(kv).num_failed_writes == 1  # from the fallback
            stats = cache_stats(tiny_engine, kv, block_size=B)
            assert stats.num_failed_writes == 1
        finally:
            fallback_path(kv).unlink(missing_ok=True)
