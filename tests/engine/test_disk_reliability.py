"""The disk tier never uses a block it should not (issue 11, item 11 and "prove it"):
zero-length, foreign-model, foreign-dtype and foreign-shape block files are rejected
and recomputed; two processes writing the same blocks leave a consistent folder; blocks
written by a process on one torch thread are the bits a process on two computes; a
writer killed mid-block never leaves a block that is used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load

from kvtrace.engine import prefill
from kvtrace.engine.disk import SUFFIX, BlockLayout, BlockStore

B = 64


def _forge_block(cache, engine, prompt, j, *, fingerprint=None, dtype=None, keep_layers=None):
    """Rewrite block j of `prompt` as a well-formed block (right key, tokens and checksum)
    that belongs to another model: another fingerprint, dtype or layer count."""
    disk = cache.disk
    keys = disk.chain_keys(engine.fingerprint, prompt)
    path = disk.path(keys[j])
    tensors = load(path.read_bytes())
    k, v = tensors["keys"], tensors["values"]
    if dtype is not None:
        k, v = k.to(dtype), v.to(dtype)
    if keep_layers is not None:
        k, v = k[:keep_layers], v[:keep_layers]
    path.unlink()
    parent = keys[j - 1] if j else disk.root_key(engine.fingerprint)
    block_tokens = prompt[j * B : (j + 1) * B]
    assert disk.write(keys[j], parent, fingerprint or engine.fingerprint, block_tokens, k, v)
    return path


def _assert_rejected_and_recomputed(tiny_engine, make_cache, kv_equal, prompt, path):
    reader = make_cache(tiny_engine)
    hot = prefill(tiny_engine, reader, prompt)
    cold = prefill(tiny_engine, None, prompt)
    assert hot.num_disk_tokens == B  # block 0 only: the bad block 1 ends the walk
    assert reader.disk.num_corrupt == 1
    assert torch.equal(hot.logits, cold.logits) and kv_equal(hot, cold)
    layout = BlockLayout(
        tiny_engine.fingerprint, tiny_engine.dtype, tiny_engine.num_layers,
        tiny_engine.num_kv_heads, tiny_engine.head_dim,
    )
    key = reader.disk.chain_keys(tiny_engine.fingerprint, prompt)[1]
    assert path.is_file() and reader.disk.read(key, prompt[B : 2 * B], layout) is not None


@pytest.mark.parametrize(
    "forgery",
    [
        {"fingerprint": "another-model"},
        {"dtype": torch.float16},
        {"dtype": torch.bfloat16},
        {"keep_layers": 1},
    ],
    ids=["foreign-model", "float16", "bfloat16", "fewer-layers"],
)
def test_a_block_of_another_model_dtype_or_shape_is_rejected_and_recomputed(
    tiny_engine, tokens, make_cache, kv_equal, forgery
):
    prompt = tokens(3 * B + 5, seed=60)
    writer = make_cache(tiny_engine)
    prefill(tiny_engine, writer, prompt)
    path = _forge_block(writer, tiny_engine, prompt, 1, **forgery)
    _assert_rejected_and_recomputed(tiny_engine, make_cache, kv_equal, prompt, path)


def test_a_zero_length_block_file_is_rejected_and_recomputed(
    tiny_engine, tokens, make_cache, kv_equal
):
    prompt = tokens(3 * B + 5, seed=61)
    writer = make_cache(tiny_engine)
    prefill(tiny_engine, writer, prompt)
    path = writer.disk.path(writer.disk.chain_keys(tiny_engine.fingerprint, prompt)[1])
    path.write_bytes(b"")
    _assert_rejected_and_recomputed(tiny_engine, make_cache, kv_equal, prompt, path)


def _writer_script(tiny_folder, engine_root, kv_dir, prompt, *, num_threads=None) -> str:
    """A writer process: loads the tiny engine, says ready, prefills `prompt` on "go".

    `num_threads` sets its torch threads (default: torch's own, as a user's process has).
    """
    return textwrap.dedent(
        f"""
        import sys
        import torch
        from kvtrace.engine import KVCache, load_engine, prefill
        if {num_threads!r} is not None:
            torch.set_num_threads({num_threads!r})
        engine = load_engine({str(tiny_folder)!r}, cache_dir={str(engine_root / "cache")!r})
        cache = KVCache(engine, disk_dir={str(kv_dir)!r})
        print("ready", flush=True)
        sys.stdin.readline()  # go
        prefill(engine, cache, {prompt!r})
        print("done", flush=True)
        """
    )


def _start_writers(count, script):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    processes = [
        subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(count)
    ]
    for process in processes:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready", (
            process.stderr.read() if process.stderr else ""
        )
    for process in processes:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
    return processes


def _check_folder(tiny_engine, kv_dir, prompt) -> int:
    """Every block file in the folder is whole and right for `prompt`; returns how many."""
    disk = BlockStore(kv_dir, block_size=B)
    layout = BlockLayout(
        tiny_engine.fingerprint, tiny_engine.dtype, tiny_engine.num_layers,
        tiny_engine.num_kv_heads, tiny_engine.head_dim,
    )
    keys = disk.chain_keys(tiny_engine.fingerprint, prompt)
    blocks = {p for p in kv_dir.rglob(f"*{SUFFIX}") if not p.name.startswith(".tmp-")}
    for j, key in enumerate(keys):
        if disk.path(key) in blocks:
            assert disk.read(key, prompt[j * B : (j + 1) * B], layout) is not None, j
    assert blocks <= {disk.path(key) for key in keys}
    assert disk.num_corrupt == 0
    return len(blocks)


def test_two_processes_writing_the_same_blocks_leave_a_consistent_folder(
    tiny_engine, tiny_folder, engine_root, tokens, make_cache, kv_dir, kv_equal
):
    prompt = tokens(20 * B, seed=62)
    processes = _start_writers(2, _writer_script(tiny_folder, engine_root, kv_dir, prompt))
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0 and "done" in out, err[-2000:]
    assert _check_folder(tiny_engine, kv_dir, prompt) == 20
    assert not list(kv_dir.rglob(".tmp-*"))
    hot = prefill(tiny_engine, make_cache(tiny_engine), [*prompt, 5])
    assert hot.num_disk_tokens == 20 * B
    cold = prefill(tiny_engine, None, [*prompt, 5])
    assert kv_equal(hot, cold), _where_kv_differs(hot, cold)


def test_blocks_written_on_one_thread_are_the_bits_two_threads_compute(
    tiny_engine, tiny_folder, engine_root, tokens, make_cache, kv_dir, kv_equal
):
    """The folder is shared by processes whatever their thread counts (the fingerprint
    does not name one): a one-thread writer's blocks must be what a two-thread reader
    computes, on the prefill's every chunk shape (512-row chunks, a padded tail)."""
    prompt = tokens(20 * B + 37, seed=64)
    script = _writer_script(tiny_folder, engine_root, kv_dir, prompt, num_threads=1)
    (process,) = _start_writers(1, script)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0 and "done" in out, err[-2000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        hot = prefill(tiny_engine, make_cache(tiny_engine), [*prompt, 5])
        cold = prefill(tiny_engine, None, [*prompt, 5])
    finally:
        torch.set_num_threads(threads)
    assert hot.num_disk_tokens == 20 * B
    assert kv_equal(hot, cold), _where_kv_differs(hot, cold)


def _where_kv_differs(a, b) -> str:
    """Which layers and blocks of rows differ, and by how much (for a failure's message:
    this test failed once in a busy full run and never again, so say where)."""
    found = []
    for index, (x, y) in enumerate(zip(a.kv.layers, b.kv.layers, strict=True)):
        for name, p, q in (("keys", x.keys, y.keys), ("values", x.values, y.values)):
            if p.shape != q.shape:
                found.append(f"layer {index} {name}: shapes {tuple(p.shape)} {tuple(q.shape)}")
                continue
            rows = (p != q).flatten(0, 1).any(dim=-1).any(dim=0).nonzero().flatten().tolist()
            if rows:
                blocks = sorted({row // B for row in rows})
                found.append(f"layer {index} {name}: {len(rows)} rows in blocks {blocks}, "
                             f"max diff {(p - q).abs().max().item():.3g}")
    return "; ".join(found) or "same tensors (another field differs)"


def test_a_writer_killed_mid_block_never_leaves_a_block_that_is_used(
    tiny_engine, tiny_folder, engine_root, tokens, make_cache, kv_dir, kv_equal
):
    prompt = tokens(40 * B, seed=63)
    (process,) = _start_writers(1, _writer_script(tiny_folder, engine_root, kv_dir, prompt))
    time.sleep(0.2)  # mid-prefill: some blocks written, one maybe half-written
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    num_blocks = _check_folder(tiny_engine, kv_dir, prompt)  # whatever landed is whole
    reader = make_cache(tiny_engine)
    hot = prefill(tiny_engine, reader, [*prompt, 5])
    assert reader.disk.num_corrupt == 0
    assert hot.num_disk_tokens == num_blocks * B  # blocks land in chain order: a prefix
    assert kv_equal(hot, prefill(tiny_engine, None, [*prompt, 5]))
