"""`kvtrace replay` on a faulty disk tier finishes and says what happened (issue 23, item 2).

A full cache folder used to end the replay with "unexpected SafetensorError … (a bug
in kvtrace)", a read-only one with "error: Read-only file system", and a damaged
block was recomputed without a word. Now the replay finishes, its report says once
that blocks could not be written and why, names every damaged block and says it was
recomputed, and `kvtrace cache stats` counts the failed writes. The full and
read-only folders are real tmpfs mounts (root only; skipped elsewhere).
"""

from __future__ import annotations

import json

import pytest

import kvtrace.cli.replay  # noqa: F401  (registers the commands until kvtrace.cli imports it)
from kvtrace.cli import main
from kvtrace.engine.disk import BlockStore
from kvtrace.replay.recording import prompt_ids
from tests.mounts import fill, make_read_only, tmpfs

NOT_WRITTEN = "could not be written to the disk tier"


@pytest.fixture
def recorded(replay_store):
    """A two-call run whose prompts span several 64-token blocks."""
    run = replay_store.run("agent")
    messages = [{"role": "user", "content": "word " * 300}]
    run.record_model_call(list(messages), "Final Answer: 42", model="m")
    messages += [{"role": "assistant", "content": "Final Answer: 42"},
                 {"role": "user", "content": "again " * 100}]
    run.record_model_call(list(messages), "ok", model="m")
    return replay_store


def _kvtrace(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def _replay(capsys, store, engine, *extra):
    # In the engine's dtype: its fingerprint names the blocks these tests damage.
    dtype = str(engine.dtype).removeprefix("torch.")
    return _kvtrace(capsys, "--store", store.url, "replay", "agent", "--model",
                    str(engine.path), "--dtype", dtype, *extra)


def test_a_replay_on_a_full_disk_finishes_and_says_once_why(
    recorded, tiny_engine, tmp_path, monkeypatch, capsys
):
    with tmpfs(tmp_path / "cache", size="1m") as cache:
        monkeypatch.setenv("KVTRACE_CACHE", str(cache))
        fill(cache, leave=12 * 1024)  # room for small files, not for a 32 KiB block
        code, out, err = _replay(capsys, recorded, tiny_engine)
        assert (code, err) == (0, "")
        text = " ".join(out.split())
        assert text.count(NOT_WRITTEN) == 1 and "No space left on device" in text

        code, out, _ = _kvtrace(capsys, "cache", "stats", "--model", str(tiny_engine.path))
        assert code == 0
        assert "failed writes    2 (last: No space left on device)" in out  # one per prompt


def test_a_replay_on_a_read_only_cache_finishes_and_says_why(
    recorded, tiny_engine, tmp_path, monkeypatch, capsys
):
    with tmpfs(tmp_path / "cache", size="1m") as cache:
        monkeypatch.setenv("KVTRACE_CACHE", str(cache))
        make_read_only(cache)
        code, out, err = _replay(capsys, recorded, tiny_engine, "--json")
        assert (code, err) == (0, "")
        notes = json.loads(out)["notes"]
        assert len(notes) == 1 and NOT_WRITTEN in notes[0]
        assert "Read-only file system" in notes[0]


def _damage(path):
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 1  # one bit of the KV
    path.write_bytes(bytes(raw))


def test_a_damaged_block_is_named_in_the_report_and_recomputed(
    recorded, tiny_engine, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    code, out, _ = _replay(capsys, recorded, tiny_engine, "--json")
    assert code == 0 and json.loads(out)["notes"] == []
    first = recorded.path("agent")[0]
    store = BlockStore(tmp_path / "cache" / "kv")
    key = store.chain_keys(tiny_engine.fingerprint, prompt_ids(tiny_engine, first))[0]
    _damage(store.path(key))

    code, out, _ = _replay(capsys, recorded, tiny_engine, "--json")
    report = json.loads(out)
    assert code == 0 and report["steps"][0]["disk_tokens"] == 0
    assert len(report["notes"]) == 1
    note = report["notes"][0]
    assert note.startswith(f"step @{first.depth}: KV block {key[:16]}")
    assert "checksum mismatch" in note and "recomputed" in note
    assert store.path(key).is_file()  # rewritten

    _damage(store.path(key))
    code, out, _ = _replay(capsys, recorded, tiny_engine)  # the table's notes say it too
    assert code == 0 and f"note: {note}" in " ".join(out.split())


def test_a_replay_past_the_disk_budget_says_what_was_evicted(
    recorded, tiny_engine, tmp_path, monkeypatch, capsys
):
    """Issue 41, item 6: a disk tier at its budget ($KVTRACE_KV_DISK_MAX) evicts, and says so."""
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    block = 64 * tiny_engine.kv_bytes_per_token
    monkeypatch.setenv("KVTRACE_KV_DISK_MAX", str(2 * block + block // 2))
    code, out, err = _replay(capsys, recorded, tiny_engine, "--json")
    assert (code, err) == (0, "")
    [note] = json.loads(out)["notes"]
    assert "reached its budget" in note and "evicted" in note
    assert len(list((tmp_path / "cache" / "kv").rglob("*.safetensors"))) <= 2

    code, out, _ = _kvtrace(capsys, "cache", "stats", "--model", str(tiny_engine.path))
    assert code == 0 and "evicted          " in out


def test_a_disk_budget_that_is_no_size_is_refused_before_loading(
    recorded, tiny_engine, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVTRACE_KV_DISK_MAX", "lots")
    code, out, err = _replay(capsys, recorded, tiny_engine)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "$KVTRACE_KV_DISK_MAX" in err and "'lots'" in err
    assert not (tmp_path / "cache" / "kv").exists()
