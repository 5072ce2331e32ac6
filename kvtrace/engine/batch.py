"""One engine thread that decodes concurrent generations together.

`DecodeBatcher(engine, cache)` is the engine and its KV cache made safe to
use from many threads: `generate` (the arguments of
`kvtrace.engine.generation`) and `call` (any other work on the cache, e.g. a
replay's rebuild prefill) queue a job and wait for it. One thread, started
at the first job, does all the work, in a loop like a serving engine's:

1. admit queued jobs: a call runs; a generation is prefilled (`begin`) and
   joins the running ones, up to `max_batch` (the rest wait their turn); one
   whose `is_cancelled` already says so fails at once, never prefilled (its
   caller left while it waited);
2. each running generation chooses its next token from its own logits (its
   own seeded generator when sampling), or is over: a stop token,
   `max_new_tokens`, or `is_cancelled` saying so (GenerationCancelledError
   for that caller only); a finished one stores its output as `generate`
   does (`insert_output` / `defer_output`) and leaves;
3. one forward feeds every running generation its token (decode.py: the
   linear layers over all rows, attention per sequence on its own KV).

What a generation gets is exactly what `generate` gives alone: the same
functions run it (`begin`, `Generation.advance`, `decode_step`,
`Generation.finish`) and a decode step gives a sequence the same bits
whatever else shares it (decode.py). So are the cache's contents: prompts
and outputs are stored by the same prefills, in admission and finishing
order.

KV that must outlive a prefill: a prefill may take over the buffers of one
of the cache's live sequences, the last ones prefilled (cache.py), and write
over rows past the prefix it reuses. Before every prefill, the generation
begun last, if it is still decoding, moves its KV into buffers of its own
(`Decoding.detach`, one copy of its rows): only that one can still decode in
buffers the cache holds live (every earlier one was moved at the prefill
after its own), so no prefill writes where a running generation reads; only
concurrent generations pay for it, and one after another none does.

Which thread loads the engine matters on the CPU: the first thread in the
process to run torch's parallel operations keeps them cheap, and every
later one pays tens of microseconds a call, a few hundred times a decode
step (a padded step 62-65 ms on the first thread, 97-124 on another;
docs/benchmarks.md, "where the regression is"): each thread gets its own
OpenMP team, and once libgomp manages more threads than there are CPUs it
stops spinning, so every parallel region waits for a woken worker (a
bfloat16 `mul` of 96 x 1536: 27 µs alone, 93 µs on a second thread).
`DecodeBatcher.loading` therefore loads the engine on the
engine thread itself, before anything else in the process computes; a
server uses it.

`close` lets every queued job finish, then ends the thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvtrace.engine.decode import decode_step
from kvtrace.engine.generation import GenerateOptions, GenerateResult, Generation, begin
from kvtrace.engine.heap import HeapTrimmer
from kvtrace.engine.model import Engine
from kvtrace.engine.prefilling import ROW_MULTIPLE
from kvtrace.engine.statecache import PrefixCache
from kvtrace.errors import GenerationCancelledError, UsageError

T = TypeVar("T")

DEFAULT_MAX_BATCH = ROW_MULTIPLE  # at most one 16-row decode forward


class _Job:
    """A queued request and, once done, its result or error (for the waiting caller)."""

    __slots__ = ("done", "error", "options", "prompt_ids", "result", "work")

    def __init__(
        self,
        *,
        work: Callable[[], Any] | None = None,
        prompt_ids: Sequence[int] = (),
        options: GenerateOptions | None = None,
    ) -> None:
        self.work = work
        self.prompt_ids = prompt_ids
        self.options = options
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def succeed(self, result: Any) -> None:
        self.result = result
        self.done.set()

    def fail(self, error: BaseException) -> None:
        if isinstance(error, GenerationCancelledError):
            # A fresh one: the raised one's traceback holds the engine thread's
            # frames, and through them the generation's KV.
            error = GenerationCancelledError(str(error))
        self.error = error
        self.done.set()


class DecodeBatcher:
    """The engine and its cache behind one thread that decodes generations together."""

    def __init__(
        self, engine: Engine, cache: PrefixCache | None, *, max_batch: int = DEFAULT_MAX_BATCH
    ) -> None:
        if max_batch < 1:
            raise UsageError(f"max_batch={max_batch}: at least 1 generation", param="max_batch")
        self.engine = engine
        self.cache = cache
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running: list[tuple[_Job, Generation]] = []
        self._live: Generation | None = None  # the generation whose KV the cache holds live
        self._thread: threading.Thread | None = None
        self._closed = False
        self._trimmer: HeapTrimmer | None = None
        self.num_steps = 0  # decode forwards run
        self.num_step_rows = 0  # generations they decoded, summed
        self.max_step_rows = 0  # the most generations one forward decoded
        # Seconds spent decoding: choosing tokens, decode forwards, the KV copies of
        # overlapping generations; not prefills or output inserts (for throughput figures).
        self.decode_seconds = 0.0

    @classmethod
    def loading(
        cls,
        load: Callable[[], tuple[Engine, PrefixCache | None]],
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> DecodeBatcher:
        """A batcher whose engine thread first runs `load` (the engine and its cache), so
        that the thread decoding is the one that loaded the model (module docstring).

        Blocks until `load` is done; raises what it raised, and then no thread is left.
        """
        started = threading.Event()
        outcome: list[DecodeBatcher | BaseException] = []

        def run() -> None:
            try:
                engine, cache = load()
                batcher = cls(engine, cache, max_batch=max_batch)
                batcher._thread = threading.current_thread()
            except BaseException as exc:  # for the caller, on its own thread
                outcome.append(exc)
                started.set()
                return
            outcome.append(batcher)
            started.set()
            batcher._loop()

        threading.Thread(target=run, name="kvtrace-decode", daemon=True).start()
        started.wait()
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def generate(self, prompt_ids: Sequence[int], options: GenerateOptions) -> GenerateResult:
        """`kvtrace.engine.generate_with(engine, cache, prompt_ids, options)`, decoded with
        the others.

        Blocks until the generation is over; the same result, tokens and
        logits as alone. `options.is_cancelled` is asked on the engine thread.
        """
        result: GenerateResult = self._wait(_Job(prompt_ids=list(prompt_ids), options=options))
        return result

    def call(self, work: Callable[[], T]) -> T:
        """Run `work()` on the engine thread between decode steps; its result.

        For anything else that uses the engine or the cache (a rebuild's
        `prefill`, `settle`, cache stats): running generations keep their KV.
        """
        if threading.current_thread() is self._thread:
            return work()  # from the engine thread itself (an is_cancelled callback)
        result: T = self._wait(_Job(work=work))
        return result

    @property
    def num_waiting(self) -> int:
        """Jobs queued and not yet admitted (generations beyond `max_batch` wait here)."""
        with self._cond:
            return len(self._queue)

    @property
    def num_running(self) -> int:
        """Generations being decoded."""
        return len(self._running)

    def close(self) -> None:
        """Finish every queued job, then stop the thread (later jobs are refused)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> DecodeBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait(self, job: _Job) -> Any:
        with self._cond:
            if self._closed:
                raise UsageError("this DecodeBatcher is closed")
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="kvtrace-decode", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def keep_heap_trimmed(self, trimmer: HeapTrimmer | None = None) -> HeapTrimmer:
        """From now on the engine thread gives the heap's free pages back between its work
        (kvtrace/engine/heap.py): what a long-lived server wants, not a one-shot command."""
        with self._cond:
            if self._trimmer is None:
                self._trimmer = trimmer or HeapTrimmer()
                self._cond.notify_all()
            return self._trimmer

    def _loop(self) -> None:
        while True:
            with self._cond:
                is_idle = False
                while not self._queue and not self._running and not self._closed:
                    wait = self._trimmer.idle_wait() if self._trimmer is not None else None
                    if (not self._cond.wait(wait) and not self._queue and not self._running
                            and not self._closed):
                        is_idle = True  # the wait ran out with nothing new: trim
                        break
                if not is_idle and not self._queue and not self._running:
                    return  # closed, and nothing left to do
                jobs = [] if is_idle else self._take()
                trimmer = self._trimmer
            if is_idle and trimmer is not None:
                trimmer.trim()  # idle after work: its transient pages go back
                continue
            for job in jobs:
                self._admit(job)
            self._step()
            if trimmer is not None:
                trimmer.worked()

    def _take(self) -> list[_Job]:
        """Queued calls, and generations while the batch has room, in queue order."""
        room = self.max_batch - len(self._running)
        taken: list[_Job] = []
        kept: deque[_Job] = deque()
        while self._queue:
            job = self._queue.popleft()
            if job.work is None and room <= 0:
                kept.append(job)
                continue
            room -= job.work is None
            taken.append(job)
        self._queue = kept
        return taken

    def _admit(self, job: _Job) -> None:
        is_cancelled = job.options.is_cancelled if job.options is not None else None
        try:
            if job.work is None and is_cancelled is not None and is_cancelled():
                raise GenerationCancelledError("generation cancelled before it started")
            self._protect(None)
            if job.work is not None:
                job.succeed(job.work())
                return
            assert job.options is not None  # a generation's job carries its options
            begun = begin(self.engine, self.cache, job.prompt_ids, job.options)
        except BaseException as exc:  # the caller's to handle; the others go on
            job.fail(exc)
            return
        if isinstance(begun, GenerateResult):
            job.succeed(begun)  # an accepted draft: nothing to decode
            return
        self._live = begun
        self._running.append((job, begun))

    def _step(self) -> None:
        stepping: list[tuple[_Job, Generation]] = []
        for job, generation in self._running:
            try:
                started = time.perf_counter()
                is_over = generation.advance()
                self.decode_seconds += time.perf_counter() - started
                if is_over:
                    self._protect(generation)
                    job.succeed(generation.finish())
            except BaseException as exc:
                job.fail(exc)
                continue
            if not is_over:
                stepping.append((job, generation))
        self._running = stepping
        if not stepping:
            return
        started = time.perf_counter()
        try:
            decode_step(self.engine, [generation.decoding for _, generation in stepping])
        except BaseException as exc:
            for job, _ in stepping:
                job.fail(exc)
            self._running = []
            return
        self.decode_seconds += time.perf_counter() - started
        self.num_steps += 1
        self.num_step_rows += len(stepping)
        self.max_step_rows = max(self.max_step_rows, len(stepping))

    def _protect(self, finishing: Generation | None) -> None:
        """Before a prefill: the running generation the cache holds live keeps its KV."""
        live = self._live
        if live is None or live is finishing:
            return
        self._live = None
        if any(generation is live for _, generation in self._running):
            started = time.perf_counter()
            live.decoding.detach()
            self.decode_seconds += time.perf_counter() - started
