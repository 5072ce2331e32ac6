"""The tracer's replay mode: `kvtrace.replaying(run, until=K)`, tools and HTTP replayed together.

    with kvtrace.replaying("base", until=6, store=store) as replay:
        run_my_agent()          # its @kvtrace.tool functions and RecordingTransport clients
    print(replay.summary.line())

Inside the block, the agent's own calls are answered from run `base` for
as long as they are the recording's next steps, up to step K: a call of a
`kvtrace.tool` function whose tool and arguments are the next recorded tool
call's returns the recorded result (or raises the recorded error) and the
function does not run; a request through a `RecordingTransport` (or its
async twin) that matches the next recorded model call (or other HTTP
exchange) is answered from the recording as `ReplayTransport(until=K)`
answers it. Nothing is recorded for those: the fork will hold the
recording's own steps. From step K on, or at the first call that differs,
everything runs live and is recorded on one fork of the run, made where
the two parted (`RecordedPrefix.go_live`, tracer/prefix.py, which does the
matching for both kinds): tool calls and model calls alike, whatever run
their decorator or transport names, so the fork holds them in the order
they happened. `edit` replaces step K's fields (a tool call's `result`, a
model call's `response`): the agent is answered with the edited value, a
true counterfactual for everything the agent does after it.

One session is current per context (a context variable): asyncio tasks
started inside the block, and `asyncio.to_thread`, see it; a thread started
by hand does not. Calls are taken one at a time under a lock, since an
agent's calls depend on the answers before them. Bad input (an unknown run,
K past the end, an edit that does not fit step K, a fork name taken) raises
before the block starts, and nothing is recorded. Light on purpose: the
matching (which needs httpx) is loaded when a block starts.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvtrace.errors import UsageError
from kvtrace.store import Run, Step, Store
from kvtrace.tracer.context import REPLAYING
from kvtrace.tracer.recorder import Recorder

if TYPE_CHECKING:
    import httpx

    from kvtrace.tracer.prefix import PrefixSummary, RecordedPrefix



class Replaying:
    """One replay of a run's steps 1..K to an agent's tools and HTTP clients (module doc)."""

    def __init__(self, prefix: RecordedPrefix) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._live: Recorder | None = None

    def __repr__(self) -> str:
        return f"Replaying({self.summary.spec!r}, fork={self.summary.fork!r})"

    @property
    def summary(self) -> PrefixSummary:
        """What was served and where the live part started (`summary.line()`)."""
        return self._prefix.summary

    @property
    def is_live(self) -> bool:
        return self._live is not None

    @property
    def fork(self) -> Run | None:
        """The run the live part is recorded on (None while nothing went live)."""
        return self._live.run if self._live is not None else None

    def take_request(self, request: httpx.Request) -> httpx.Response | Recorder:
        """The recorded answer to `request`, or the fork's recorder to record it live on."""
        from kvtrace.tracer.served import served_response

        taken = self._take(lambda: self._prefix.serve(request))
        return served_response(taken, request) if isinstance(taken, Step) else taken

    def take_tool(self, name: str, arguments: Any) -> Step | Recorder:
        """The recorded call of tool `name` with `arguments` (JSON data), or the fork's
        recorder to run and record it live on."""
        return self._take(lambda: self._prefix.serve_tool(name, arguments))

    def _take(self, serve: Any) -> Step | Recorder:
        with self._lock:
            if self._live is None:
                step: Step | None = serve()
                if step is not None:
                    return step
                self._live = Recorder(self._prefix.go_live())
            return self._live


@contextmanager
def replaying(run: str | Run | Recorder, until: int, *, store: Store | None = None,
              fork: str | None = None,
              edit: Mapping[str, Any] | None = None) -> Iterator[Replaying]:
    """Answer the agent's tool calls and HTTP from `run`'s steps 1..`until`, then go live on
    a fork (`fork`, by default `RUN-from-K`); see the module docstring.

    `run` is a run's name (with `store`) or a Run. `edit` replaces fields of
    step `until`, which must be a model call made over HTTP or a tool call.
    """
    from kvtrace.tracer.prefix import RecordedPrefix

    name, store = _run_and_store(run, store)
    if REPLAYING.get() is not None:
        raise UsageError("replaying blocks do not nest: leave the current one first")
    session = Replaying(RecordedPrefix.of_run(store, name, until, fork=fork, edit=edit,
                                              tools=True))
    token = REPLAYING.set(session)
    try:
        yield session
    finally:
        REPLAYING.reset(token)


def _run_and_store(run: str | Run | Recorder, store: Store | None) -> tuple[str, Store]:
    if isinstance(run, Recorder):
        run = run.run
    if isinstance(run, Run):
        if store is not None and store is not run.store:
            raise UsageError("run is a Run of another store than store=", param="store")
        return run.name, run.store
    if not isinstance(run, str):
        raise UsageError(f"run must be a run's name or a Run, not {type(run).__name__}",
                         param="run")
    if store is None:
        raise UsageError(f"replaying({run!r}, ...) needs the store the run is in: pass "
                         "store=STORE", param="store")
    return run, store
