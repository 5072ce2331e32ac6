"""Replay through the local engine and its two-tier KV prefix cache.

Every engine call replay makes goes through this module, so it is the one
place that knows the engine's API. The engine's `prefill` reuses the longest
cached prefix (memory tier, then disk), computes the rest in canonical
chunks and inserts it into both tiers; `generate` does the same for the
prompt, then decodes, and leaves prompt + generated tokens cached (in verify,
also prompt + recorded response: the draft it checked).

Verify hands the engine the recorded output as a draft, checked in one
prefill of prompt + draft, with a fallback to decoding when it is rejected (see
`kvtrace.engine.generation`).

A generated output is not re-prefilled at once: the cache owes it
(`defer_output`, see `kvtrace.engine.generation`), and the next prompt that
contains it computes it in its own forward. Those tokens are reported as
memory reuse of that prompt, as they would be had the output been stored
straight away (and the oracle counts them so). `defer_output=False` stores
each output before returning, for callers whose next request may be another
process's or never come (the server). `settle()` stores what is still owed:
replay, continue and branch call it as they finish, so the disk tier holds
every output, as without deferral.

Rebuild feeds the prompt and the recorded output in ONE prefill: no decoding
loop, and the cache ends up holding exactly the sequence a generation would
have left. Its accounting is split at the prompt's end: reuse counts for the
prompt up to ``len(prompt) - 1`` tokens (the last prompt token counts as
computed, as it must be when generating), which keeps the hit rate comparable
across modes and with the oracle bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvtrace.errors import BackendError, ReplayError, UsageError
from kvtrace.replay.backend import Backend, CallRequest, CallResult, Tokenizer
from kvtrace.replay.recording import output_text

T = TypeVar("T")

if TYPE_CHECKING:  # the engine imports torch: load it only when a backend is built
    from kvtrace.engine import Engine, PrefillResult, PrefixCache
    from kvtrace.engine.batch import DecodeBatcher
    from kvtrace.engine.faults import DiskFaults


class LocalBackend:
    """The engine, with a KV cache (or none: every token computed)."""

    def __init__(self, engine: Engine, cache: PrefixCache | None, *,
                 defer_output: bool = True, batcher: DecodeBatcher | None = None,
                 credit_owed: bool = True) -> None:
        self._engine = engine
        self._cache = cache
        self._defer_output = defer_output
        self._credit_owed = defer_output and credit_owed
        self._batcher = batcher

    def batching(self, *, max_batch: int | None = None) -> LocalBackend:
        """This backend behind one engine thread (`kvtrace.engine.batch.DecodeBatcher`):
        `generate`, `rebuild` and `settle` may then be called from many threads, and
        concurrent generations are decoded together, each with the result it gets alone.
        A backend that batches already is returned as it is (one engine, one thread)."""
        from kvtrace.engine.batch import DEFAULT_MAX_BATCH, DecodeBatcher

        if self._batcher is not None:
            return self

        batcher = DecodeBatcher(self._engine, self._cache,
                                max_batch=max_batch or DEFAULT_MAX_BATCH)
        return LocalBackend(self._engine, self._cache, defer_output=self._defer_output,
                            batcher=batcher, credit_owed=self._credit_owed)

    @property
    def batcher(self) -> DecodeBatcher | None:
        """The engine thread this backend's calls go through (`batching`), or None."""
        return self._batcher

    def close(self) -> None:
        """Stop the batcher's engine thread once its queued jobs are done (if it has one)."""
        if self._batcher is not None:
            self._batcher.close()

    @property
    def name(self) -> str:
        return "local" if self._cache is not None else "local (no cache)"

    @property
    def model(self) -> str:
        return self._engine.name

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine

    @property
    def is_concurrent(self) -> bool:
        """Only behind a DecodeBatcher (`batching()`): the engine alone is not thread-safe."""
        return self._batcher is not None

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def threads(self) -> str:
        """How many threads the engine computes on, and what the count follows
        (kvtrace/engine/threads.py)."""
        from kvtrace.engine.threads import engine_threads

        return engine_threads().describe()

    @property
    def cache(self) -> PrefixCache | None:
        return self._cache

    def storing_output(self) -> LocalBackend:
        """This backend with each generated output stored before `generate` returns."""
        return LocalBackend(self._engine, self._cache, defer_output=False, batcher=self._batcher)

    def owing_output(self) -> LocalBackend:
        """This backend with each generated output owed (module docstring) and never counted
        as reused: a prompt that holds it computes it and reports it computed.

        For a server: the answer goes back without the forward that would store
        its output, a next request that holds the output computes it in its own
        forward (no more work than storing it, in one forward less), and one that
        does not (a fork, a retry, a rebuild's `max_tokens=1`) never pays for it;
        `cached_tokens` still counts only KV the cache held.
        """
        return LocalBackend(self._engine, self._cache, defer_output=True, batcher=self._batcher,
                            credit_owed=False)

    def settle(self) -> None:
        """Store owed outputs (module docstring), so a later process finds them on disk."""
        from kvtrace.engine import settle

        self._run(lambda: settle(self._engine, self._cache))

    @property
    def resume_every(self) -> int:
        """1 for full-attention models (any token); the block size for window/state layers."""
        if self._cache is None or self._engine.layout.is_plain:
            return 1
        return self._cache.block_size

    @property
    def engine_facts(self) -> None:
        """None: the tokenizer and blocks are kvtrace's own (resume_every says the blocks)."""
        return None

    def engine_counters(self) -> None:
        """None: the report counts this cache's tiers itself."""
        return None

    def reset_cache(self) -> str:
        raise UsageError("resetting the cache is for a remote engine: the local engine "
                         "replays uncached with --no-cache, or from an empty KV folder "
                         "($KVTRACE_CACHE)", param="reset_cache")

    def take_cache_faults(self) -> DiskFaults | None:
        """The disk tier's faults since last asked (see `KVCache.take_disk_faults`)."""
        return self._cache.take_disk_faults() if self._cache is not None else None

    def without_cache(self) -> Backend:
        return LocalBackend(self._engine, None, defer_output=self._defer_output,
                            credit_owed=self._credit_owed)

    def generate(self, request: CallRequest, *,
                 is_cancelled: Callable[[], bool] | None = None) -> CallResult:
        """`request`'s answer; `is_cancelled` may stop it between decode steps (the engine's
        `generate`: GenerationCancelledError)."""
        from kvtrace.engine import GenerateOptions, generate_with

        prompt = self._prompt_ids(request)
        options = GenerateOptions.sampled(
            request.params, draft_ids=request.draft_ids, defer_output=self._defer_output,
            is_cancelled=is_cancelled)
        out = (self._batcher.generate(prompt, options) if self._batcher is not None
               else generate_with(self._engine, self._cache, prompt, options))
        ids = list(out.token_ids)
        # A backend that stores its output, or does not credit owed output, reports only
        # KV the cache held, even on a cache another backend owes output to.
        memory, disk = _prompt_reuse(out.prefill, len(prompt), credit_owed=self._credit_owed)
        return CallResult(
            prompt_tokens=len(prompt),
            reused_tokens=memory + disk,
            memory_tokens=memory,
            disk_tokens=disk,
            text=output_text(self._engine, ids),
            output_ids=ids,
            finish_reason=out.finish_reason,
            prefill_s=out.prefill_seconds,
            # Storing the output canonically (so the next prompt hits it) is
            # part of the cost of generating with a cache (0 when deferred: the
            # next prompt's prefill pays it).
            decode_s=out.decode_seconds + out.insert_seconds,
            seed=out.seed,
            draft=out.draft,
        )

    def _run(self, work: Callable[[], T]) -> T:
        """`work()`, on the batcher's engine thread when there is one."""
        return self._batcher.call(work) if self._batcher is not None else work()

    def _prompt_ids(self, request: CallRequest) -> list[int]:
        """The prompt's ids, refused past the model's context as a server refuses them."""
        if request.prompt_ids is None:
            raise ReplayError("the local backend needs token ids: the driver tokenises with it")
        limit = self._engine.max_context_tokens
        if limit is not None and len(request.prompt_ids) >= limit:
            raise BackendError(
                f"the prompt takes {len(request.prompt_ids)} tokens: the model's maximum context "
                f"length is {limit}; replay it with a model of a longer context"
            )
        return list(request.prompt_ids)

    def rebuild(self, request: CallRequest) -> CallResult:
        from kvtrace.engine import prefill

        prompt = self._prompt_ids(request)
        output = list(request.output_ids or [])
        started = time.perf_counter()
        result = self._run(lambda: prefill(self._engine, self._cache, prompt + output))
        elapsed = time.perf_counter() - started
        memory, disk = _prompt_reuse(result, len(prompt))
        return CallResult(
            prompt_tokens=len(prompt),
            reused_tokens=memory + disk,
            memory_tokens=memory,
            disk_tokens=disk,
            text=request.output_text or output_text(self._engine, output),
            output_ids=output,
            finish_reason="recorded",
            prefill_s=elapsed,
            decode_s=0.0,
        )


def open_local_backend(
    model: str | None = None,
    *,
    cache_dir: Path,
    kv_dir: Path | None = None,
    use_cache: bool = True,
    memory_bytes: int | None = None,
    on_convert: Callable[[str], None] | None = None,
    batching: bool = False,
    dtype: str | None = None,
) -> LocalBackend:
    """Load the engine and a two-tier KV cache.

    `model` is a model folder, or None for the embedded default, converted
    once under `cache_dir/models`. Disk KV blocks go to `kv_dir` (default
    `cache_dir/kv`, where `kvtrace cache` looks), bounded by
    `$KVTRACE_KV_DISK_MAX` (paths.py): another `kv_dir` gives a
    fresh, empty cache that still reuses the converted model. `on_convert` is
    told before that one-time conversion (`load_engine`).

    `batching`: the backend `LocalBackend.batching` gives, with the engine
    loaded on its engine thread (`DecodeBatcher.loading`: on another thread
    than the loading one, every decode step costs a third more); its `close`
    stops that thread. For a server, or anything else that generates from
    many threads. `dtype`: the engine's number format (`load_engine`; None:
    float32).
    """
    from kvtrace.paths import kv_disk_budget

    disk_bytes = kv_disk_budget()  # a budget that is no size fails before anything loads

    from kvtrace.engine import load_engine, open_cache
    from kvtrace.engine.batch import DecodeBatcher
    from kvtrace.engine.maintenance import default_kv_dir

    def load() -> tuple[Engine, PrefixCache | None]:
        engine = load_engine(model, cache_dir=cache_dir, on_convert=on_convert, dtype=dtype)
        if not use_cache:
            return engine, None
        options: dict[str, Any] = {"disk_bytes": disk_bytes}
        if memory_bytes is not None:
            options["memory_bytes"] = memory_bytes
        disk_dir = kv_dir or default_kv_dir(cache_dir)
        # Blocks are written inline: write-behind measured 17-22 % slower on the
        # 2-core machines (its thread competes with torch's; docs/benchmarks.md).
        return engine, open_cache(engine, disk_dir=disk_dir, **options)

    if not batching:
        return LocalBackend(*load())
    batcher = DecodeBatcher.loading(load)
    return LocalBackend(batcher.engine, batcher.cache, batcher=batcher)


def _prompt_reuse(stats: PrefillResult, prompt_len: int, *,
                  credit_owed: bool = True) -> tuple[int, int]:
    """(memory, disk) tokens reused for the prompt, capped at ``prompt_len - 1``.

    Disk blocks come first in a lookup (they hold a prefix from the root), then
    memory continues, then owed output (module docstring), counted as memory;
    the cap takes from the end, i.e. from memory first.
    """
    limit = max(prompt_len - 1, 0)
    disk = min(stats.num_disk_tokens, limit)
    owed = stats.num_deferred_tokens if credit_owed else 0
    memory = min(stats.num_memory_tokens + owed, limit - disk)
    return memory, disk
