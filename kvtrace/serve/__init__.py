"""`kvtrace serve`: an HTTP server for three model APIs that records every call into a run.

It answers OpenAI chat completions (`/v1/chat/completions`), Anthropic
Messages (`/v1/messages`) and OpenAI Responses (`/v1/responses`), from the
local engine or by forwarding to an upstream.

`make_server(backend=... | upstream=..., store=...)` builds one; run its
`app` with `BackgroundServer` (runner.py) or any ASGI server. The modules:

- app.py: `ChatServer`, the routes, the bearer-token and body-size checks;
- agents.py: K copies of one agent against one server (`record --n K`): agent
  i's base URL `/a/i/v1`, its fork and its seed;
- disconnect.py: work stopped when its client leaves before the answer;
- answerer.py: the `Answerer` interface the app calls, implemented by
  local.py (`LocalAnswerer`: the engine, through replay's local backend) and
  upstream.py (`UpstreamAnswerer`: forwards to another server);
- recording.py: which run a request is recorded into, the store writer
  thread, the per-run stats (`store=None`: nothing is recorded);
- request.py: the body checks all three APIs share, their common fields
  and the errors; api.py: the chat request's checks; anthropic_api.py and
  responses_api.py: the other two APIs' requests, answers and SSE events;
  chat_reply.py: chat's local answer;
  generation.py: what the engine is asked and made, whatever the API;
  openapi.py: the three request schemas in `GET /openapi.json`;
- runner.py: `BackgroundServer`, uvicorn on a thread, and the program
  `kvtrace record` runs, with the SDKs' environment pointed at the server.

Layering: imports the tracer (what an exchange records, the Recorder, the
Redactor, SSE), the store, and replay's local backend; the CLI and the
benchmarks import it, never the tracer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtrace.errors import UsageError
from kvtrace.serve.agents import Agent
from kvtrace.serve.answerer import Answerer
from kvtrace.serve.app import DEFAULT_MAX_BODY_BYTES, ChatServer, check_api_key
from kvtrace.serve.loading import BackendLoad, LoadingAnswerer, start_loading
from kvtrace.serve.models import ByAgent, ModelNamed
from kvtrace.serve.recording import Recording, RunStats
from kvtrace.serve.runner import BackgroundServer
from kvtrace.serve.upstream import DEFAULT_TIMEOUT_S, UpstreamAnswerer

if TYPE_CHECKING:
    from kvtrace.replay.local import LocalBackend
    from kvtrace.store import Store

DEFAULT_MAX_QUEUE = 16

__all__ = ["Answerer", "BackendLoad", "BackgroundServer", "ChatServer", "RunStats",
           "make_server"]


def make_server(
    *,
    backend: LocalBackend | BackendLoad | Sequence[LocalBackend | BackendLoad] | None = None,
    upstream: str | None = None,
    upstream_models: Sequence[str] = (),
    store: Store | None = None,
    run: str | None = None,
    api_key: str | None = None,
    upstream_api_key: str | None = None,
    redact_headers: Iterable[str] = (),
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    upstream_timeout: float = DEFAULT_TIMEOUT_S,
    strict_model: bool = False,
    from_run: str | None = None,
    edit: Mapping[str, Any] | None = None,
    agents: Sequence[Agent] = (),
) -> ChatServer:
    """A server answered by `backend` (the local engine) or by `upstream` (a base URL with
    its API prefix, e.g. http://host:8080/v1): exactly one of the two.

    Every answer is recorded into `store` (None: nothing is recorded), in the
    run a request's X-Kvtrace-Run header names, else `run`, else a new run
    named at start (serve-YYYYMMDD-HHMMSS). `api_key`: the bearer token
    clients must send (then their Authorization is not forwarded);
    `upstream_api_key`: the one sent upstream instead; `redact_headers`:
    headers never stored, besides the built-in secret ones; `max_queue`:
    local mode holds at most `max_queue + 1` requests, decoded together or
    waiting for a place in the batch (past it, 429);
    `max_body_bytes`: the largest request body (past it, 413);
    `upstream_timeout`: seconds the upstream may take for each wait (to
    connect, for the next bytes of its answer; past it, 504); `strict_model`
    (local): refuse, with a 404, a request naming a model other than the
    backend's, where by default any name is answered by it (and recorded as
    `extra.request_model`). A `BackendLoad` in place of a backend is loaded
    on a thread of its own, started once every check here passed, while the
    server already answers (loading.py: `wait_loaded` gives the load's error).

    `from_run` (`RUN@K`, fromrun.py): requests that match that run's recorded
    model calls up to step K are answered from the recording; the rest are
    answered live and recorded on a fork named `run` (needed then), made
    where the two parted; `edit` replaces fields of step K. The answerer is
    then `FromRecording`, whose `summary` says what happened. With `agents`
    (agents.py: `make_agents`), K copies of the agent are answered at once,
    agent i at `/a/i/v1`, each on its own fork and with its own seed (`run`
    is then only the default run of requests that name no agent, answered
    404); `FromRecording.summaries` says what each did. Several models
    (`backend` a list of backends, or `upstream_models` names sent upstream)
    answer the agents in turn, agent i by model (i - 1) mod their number
    (models.py: `ByAgent`).
    """
    if max_body_bytes < 1:
        raise UsageError(f"max_body_bytes must be >= 1, not {max_body_bytes}")
    check_api_key(upstream_api_key, "upstream_api_key")
    redact_headers = tuple(redact_headers)
    answerer: Answerer
    if backend is not None and upstream is None:
        backends = list(backend) if isinstance(backend, Sequence) else [backend]
        locals_ = [_local_answerer(b, max_queue=max_queue, strict_model=strict_model)
                   for b in backends]
        answerer = locals_[0] if len(locals_) == 1 else ByAgent(locals_)
    elif upstream is not None and backend is None:
        if strict_model:
            raise UsageError("strict_model is for a local backend: with upstream=, the "
                             "upstream decides which model names it answers")
        answerer = UpstreamAnswerer(upstream, api_key=upstream_api_key,
                                    forwards_authorization=api_key is None,
                                    timeout=upstream_timeout)
        if len(upstream_models) == 1:
            answerer = ModelNamed(answerer, upstream_models[0])
        elif upstream_models:
            answerer = ByAgent([ModelNamed(answerer, name) for name in upstream_models],
                               shared=answerer)
    else:
        raise UsageError("make_server answers from a local backend or from an upstream URL: "
                         "give exactly one of backend= and upstream=")
    if isinstance(answerer, ByAgent) and not agents:
        raise UsageError("several models answer K agents, agent i by model (i - 1) mod the "
                         "number of models: give agents= too", param="backend")
    if agents and from_run is None:
        raise UsageError("agents are K copies of an agent forked at one step: give from_run "
                         "too", param="agents")
    if from_run is not None:
        from kvtrace.serve.fromrun import FromRecording

        if store is None or (run is None and not agents):
            raise UsageError("from_run answers from a store's run and records on a fork: "
                             "give store= and run= (the fork's name)", param="from_run")
        answerer = FromRecording(answerer, store, from_run, fork=None if agents else run,
                                 agents=agents, edit=edit,
                                 redact_headers=tuple(redact_headers))
    elif edit is not None:
        raise UsageError("edit changes the step a from_run run is answered from: give from_run",
                         param="edit")
    recording = Recording(store, run=run, redact_headers=redact_headers)
    server = ChatServer(answerer, recording, api_key=api_key, max_body_bytes=max_body_bytes,
                        agents=agents)
    start_loading(answerer)  # every check passed: the models load meanwhile (loading.py)
    return server


def _local_answerer(backend: LocalBackend | BackendLoad, *, max_queue: int,
                    strict_model: bool) -> Answerer:
    """`LocalAnswerer` on `backend`, or on it once loaded (a `BackendLoad`: loading.py)."""
    from kvtrace.serve.local import LocalAnswerer  # imports replay: not for upstream mode

    if not isinstance(backend, BackendLoad):
        return LocalAnswerer(backend, max_queue=max_queue, strict_model=strict_model)
    if max_queue < 0:  # LocalAnswerer's own check, before the load rather than in it
        raise UsageError(f"max_queue must be >= 0, not {max_queue}")
    load = backend.load

    def build() -> Answerer:
        loaded = load()
        try:
            return LocalAnswerer(loaded, max_queue=max_queue, strict_model=strict_model)
        except BaseException:
            loaded.close()
            raise

    return LoadingAnswerer(backend.model, build, strict_model=strict_model)
