"""`kvtrace cache ...`: inspect and manage the two-tier KV prefix cache.

Thin: each command parses, makes one call of `kvtrace.engine`, prints. The
cache folder is `--cache-dir` or `$KVTRACE_CACHE` (default `~/.cache/kvtrace`);
disk KV blocks live in its `kv/` folder. Heavy imports (torch) happen inside
the commands so that `kvtrace --help` stays fast.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvtrace.cli.app import Dtype, Json, Model, Precision, cache_app, print_json, say
from kvtrace.errors import UsageError
from kvtrace.paths import parse_size

if TYPE_CHECKING:
    from kvtrace.engine import Engine
    from kvtrace.engine.maintenance import CacheStats


CacheDir = Annotated[Path | None, typer.Option(
    "--cache-dir", help="kvtrace cache folder (default: $KVTRACE_CACHE or ~/.cache/kvtrace).")]
BlockSize = Annotated[int, typer.Option(
    "--block-size",
    help="Disk block size in tokens (must match the one the blocks were written with).")]


def _load(model: str | None, root: Path) -> Engine:
    """The engine, without transformers' progress bars on a command line."""
    from transformers.utils import logging as hf_logging

    from kvtrace.engine import load_engine

    hf_logging.disable_progress_bar()
    return load_engine(model, cache_dir=root)


def _cache_dir(value: Path | None) -> Path:
    from kvtrace.paths import default_cache_dir

    return value if value is not None else default_cache_dir()


@cache_app.command("stats")
def stats(
    model: Model = None,
    cache_dir: CacheDir = None,
    block_size: BlockSize = 64,
    as_json: Json = False,
) -> None:
    """Entries and bytes per tier, and the model's KV bytes per token (formula)."""
    from kvtrace.engine.maintenance import cache_stats, default_kv_dir

    root = _cache_dir(cache_dir)
    engine = _load(model, root)
    result = cache_stats(engine, default_kv_dir(root), block_size=block_size)
    if as_json:
        print_json(dataclasses.asdict(result))
        return
    per_token = result.disk_bytes_per_token
    say(f"model            {result.model}  (fingerprint {result.fingerprint[:16]})")
    if engine.layout.is_plain:
        say(
            f"KV per token     {result.kv_bytes_per_token:,} B  "
            f"(2 x {engine.num_layers} layers x {engine.num_kv_heads} kv heads x "
            f"{engine.head_dim} dims x {engine.dtype.itemsize} B)"
        )
    else:  # window and state layers: `cache size` gives bytes per kind
        say(f"layers           {engine.layout.describe()}")
        say(f"KV per token     {result.kv_bytes_per_token:,} B while every window fills "
            f"(kvtrace cache size: bytes per layer kind)")
    say(
        f"disk tier        {result.disk_blocks:,} blocks, {result.disk_bytes:,} B for this model"
        + (f" ({per_token:,.0f} B/token)" if per_token else "")
        + f"; {result.disk_blocks_all_models:,} blocks, {result.disk_bytes_all_models:,} B in all"
    )
    say(f"disk folder      {result.disk_dir}{_disk_health(result)}")
    say(
        f"failed writes    {result.num_failed_writes:,}"
        + (f" (last: {result.last_failed_write})" if result.last_failed_write else "")
        + ("" if result.is_disk_writable else "; a read-only folder cannot count its own")
    )
    say(f"evicted          {result.num_evicted_blocks:,} blocks past the disk budget "
        "($KVTRACE_KV_DISK_MAX; `cache gc` not counted)")
    say(
        f"memory tier      {result.memory_entries} entries, {result.memory_bytes:,} B "
        f"(budget {result.memory_max_bytes:,} B; empty in a new process)"
    )


def _disk_health(result: CacheStats) -> str:
    """Why blocks cannot be written there now, if they cannot."""
    block_bytes = result.kv_bytes_per_token * result.block_size
    if not result.is_disk_writable:
        return "  (read-only: no block can be written)"
    if result.disk_free_bytes is not None and result.disk_free_bytes < block_bytes:
        return (f"  ({result.disk_free_bytes:,} B free, less than one block of "
                f"{block_bytes:,} B: no block can be written)")
    return ""


@cache_app.command("size")
def size(
    model: Annotated[str | None, typer.Argument(
        help="Model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")] = None,
    tokens: Annotated[int, typer.Option(
        "--tokens", help="Tokens in the sequence (its prompt and output).")] = 4096,
    dtype: Dtype = Precision.AUTO,
    cache_dir: CacheDir = None,
    as_json: Json = False,
) -> None:
    """Bytes one sequence's cache holds, per layer kind: full, window, state."""
    from kvtrace.engine import load_engine
    from kvtrace.engine.maintenance import cache_size

    if tokens < 0:
        raise UsageError(f"--tokens {tokens}: must be >= 0")
    engine = load_engine(model, cache_dir=_cache_dir(cache_dir), dtype=dtype.value)
    result = cache_size(engine, tokens)
    if as_json:
        print_json(dataclasses.asdict(result))
        return
    say(f"model   {result.model} ({result.dtype}), {result.num_tokens:,} tokens")
    for kind in result.kinds:
        formula = []
        if kind.kv_bytes_per_token:
            rows = f"min({tokens:,}, {kind.window:,})" if kind.window else f"{tokens:,}"
            formula.append(f"{kind.kv_bytes_per_token:,} B/token x {rows} tokens")
        if kind.state_bytes:
            formula.append(f"{kind.state_bytes:,} B of state (constant)")
        say(f"{kind.kind:34s} {kind.num_layers:3d} layers  {kind.num_bytes:>16,} B  "
            f"({' + '.join(formula) or 'nothing'})")
    say(f"{'total':34s} {'':10s}  {result.num_bytes:>16,} B")


@cache_app.command("gc")
def gc(
    max_bytes: Annotated[str, typer.Option(
        "--max-bytes", help="Keep at most this many bytes of disk blocks (e.g. 2G, 500MiB).")],
    cache_dir: CacheDir = None,
    as_json: Json = False,
) -> None:
    """Evict disk blocks, least recently used tails first, down to --max-bytes."""
    limit = parse_size(max_bytes)  # before importing torch: a typo fails fast
    from kvtrace.engine.maintenance import collect_garbage, default_kv_dir

    result = collect_garbage(default_kv_dir(_cache_dir(cache_dir)), limit)
    if as_json:
        print_json(dataclasses.asdict(result))
        return
    say(
        f"removed {result.num_blocks_removed} blocks ({result.num_bytes_removed:,} B); "
        f"{result.num_blocks_left} blocks ({result.num_bytes_left:,} B) left"
    )


@cache_app.command("verify")
def verify(
    sample: Annotated[int, typer.Option(
        "--sample", help="Recompute this many random blocks (0: all).")] = 8,
    model: Model = None,
    cache_dir: CacheDir = None,
    block_size: BlockSize = 64,
    as_json: Json = False,
) -> None:
    """Recompute a sample of stored blocks and report any that differ (exit 1 if so)."""
    from kvtrace.engine.maintenance import default_kv_dir, verify_blocks

    if sample < 0:
        raise UsageError(f"--sample must be >= 0, got {sample}")
    root = _cache_dir(cache_dir)
    engine = _load(model, root)
    report = verify_blocks(
        engine, default_kv_dir(root), sample=sample or None, block_size=block_size
    )
    if as_json:
        print_json({**dataclasses.asdict(report), "is_ok": report.is_ok})
    else:
        say(
            f"checked {report.num_checked} of {report.num_blocks} blocks: "
            f"{len(report.mismatched)} mismatched, {len(report.unreadable)} unreadable (removed), "
            f"{len(report.orphaned)} orphaned"
        )
        for key in report.mismatched:
            say(f"mismatch {key}")
    if not report.is_ok:
        raise typer.Exit(1)
