"""Answering from a recorded run first: `kvtrace record --from RUN@K` and `serve --from`.

`FromRecording` wraps the server's answerer with a `RecordedPrefix`
(tracer/prefix.py, shared with `ReplayTransport(run, until=K)`): a request
that is the recording's next model call up to step K is answered from the
recording at once, streamed when asked, nothing computed and nothing
recorded; from the first request that is not, answers are live (the inner
answerer: the local engine, whose KV of the replayed prefix `warm`
computed while it loaded, loading.py, or the upstream), recorded on the fork
`RecordedPrefix.go_live` makes where the two parted (the server's default
run is that fork). Requests are taken one at a time until the agent is
live: an agent's calls depend on the answers before them.

With `agents` (`kvtrace record --n K`, agents.py), each agent has a
recorded prefix of its own, matched on its own and going live on its own
fork; a `/v1` request that comes from no agent is a 404.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx
from starlette.responses import Response

from kvtrace.errors import UsageError
from kvtrace.serve.agents import Agent, agent_of
from kvtrace.serve.loading import until_loaded
from kvtrace.serve.request import APIError
from kvtrace.tracer.prefix import PrefixSummary, RecordedPrefix
from kvtrace.tracer.served import served_response

if TYPE_CHECKING:
    from starlette.requests import Request

    from kvtrace.replay.backend import DiskFaults
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve.answerer import Answerer
    from kvtrace.serve.recording import Sink
    from kvtrace.store import Store

_NOT_SENT_ON = frozenset({"content-length", "content-encoding", "transfer-encoding"})


class FromRecording:
    """An answerer that answers from `spec`'s recorded model calls, then from `inner`."""

    def __init__(self, inner: Answerer, store: Store, spec: str, *, fork: str | None = None,
                 agents: Sequence[Agent] = (), edit: Mapping[str, Any] | None = None,
                 redact_headers: tuple[str, ...] = ()) -> None:
        forks: dict[int | None, str] = {agent.index: agent.fork for agent in agents}
        if not forks:
            if fork is None:
                raise UsageError("from_run needs the fork's name (or agents)", param="fork")
            forks[None] = fork
        self.inner = inner
        self.prefixes = {key: RecordedPrefix(store, spec, fork=name, edit=edit,
                                             redact_headers=redact_headers)
                         for key, name in forks.items()}
        self._locks = {key: asyncio.Lock() for key in forks}

    @property
    def summaries(self) -> list[PrefixSummary]:
        """What each agent's recorded part did, in agent order."""
        return [prefix.summary for prefix in self.prefixes.values()]

    @property
    def summary(self) -> PrefixSummary:
        return self.summaries[0]

    @property
    def model(self) -> str | None:
        return self.inner.model

    @property
    def required_model(self) -> str | None:
        return self.inner.required_model

    @property
    def description(self) -> str:
        summary = self.summary
        return (f"{self.inner.description}, after the {summary.num_recorded} recorded calls "
                f"of {summary.spec}")

    def take_cache_faults(self) -> DiskFaults | None:
        return self.inner.take_cache_faults()

    def health(self) -> dict[str, Any]:
        if None in self.prefixes:
            return {**self.inner.health(), "from": self.summary.to_dict()}
        return {**self.inner.health(), "from": [s.to_dict() for s in self.summaries]}

    async def close(self) -> None:
        await self.inner.close()

    async def answer(self, request: Request, body: bytes, sink: Sink) -> Response:
        agent = agent_of(request)
        key = agent.index if agent is not None else None
        prefix = self.prefixes.get(key)
        if prefix is None:
            raise APIError(404, f"this server answers {len(self.prefixes)} agents, each at "
                           "its own base URL: /a/1/v1 ... (docs/fork.md)", code="not_found")
        if not prefix.is_live and request.method == "POST":  # GET /v1/models: no call
            async with self._locks[key]:
                if not prefix.is_live:
                    live = httpx.Request(request.method, str(request.url),
                                         headers=list(request.headers.items()), content=body)
                    step = prefix.serve(live)
                    if step is not None:
                        recorded = served_response(step, live)
                        return Response(recorded.content, status_code=recorded.status_code,
                                        headers={k: v for k, v in recorded.headers.items()
                                                 if k.lower() not in _NOT_SENT_ON})
                    await until_loaded(self.inner)  # a 503, and no fork, if it failed
                    await asyncio.to_thread(prefix.go_live)
        return await self.inner.answer(request, body, sink)


def warm(store: Store, spec: str, backend: LocalBackend) -> int:
    """Rebuild the model calls of `spec` that no later one continues (a linear agent's last),
    so the KV a live call resumes from is cached before it comes; returns the prompt tokens
    replayed.

    Why not every call: a later call whose prompt's tokens begin with an earlier one's holds
    that one's KV, so rebuilding both computes the same KV twice over, piecemeal. On a short
    agent's five calls that took 1.6-2.1 s against 0.55 s for the last alone
    (docs/benchmarks.md), and a fork's first live call waits for it when the agent gets there
    first. Tokens, not messages, decide: a template that renders an earlier turn otherwise
    once later ones follow (reasoning dropped) leaves that call a leaf of its own, as is a
    sub-agent's call that the main thread does not continue.
    """
    from kvtrace.replay.driver import replay_steps, steps_to_replay
    from kvtrace.replay.recording import step_messages, step_tools
    from kvtrace.store import StepKind

    tokenizer = backend.tokenizer
    calls = [(step, tokenizer.chat_tokens(step_messages(step), tools=step_tools(step)))
             for step in steps_to_replay(store, spec) if step.kind == StepKind.MODEL_CALL]
    leaves = [step for i, (step, ids) in enumerate(calls)
              if not any(later[:len(ids)] == ids for _, later in calls[i + 1:])]
    return replay_steps(spec, leaves, backend, mode="rebuild").total.prompt_tokens
