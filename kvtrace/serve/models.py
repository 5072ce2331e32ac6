"""Several models in one experiment: `record --from RUN@K --n K --models A,B,...`.

Agent i (1..K) is answered by model `(i - 1) mod len(models)`: agents 1 and 3
by A, 2 and 4 by B, and so on. `ByAgent` is the answerer that dispatches,
one inner answerer per model:

- locally, each model is an engine of its own (a folder or a GGUF), with
  its own KV cache and decode batcher (`LocalAnswerer` each), so the agents
  of one model decode together and never share KV with another model's;
- upstream, one `UpstreamAnswerer` takes every request, each agent's
  `model` field rewritten to its model's name (`ModelNamed`), so the
  recorded request names the model that answered.

The recorded prefix is answered from the recording whatever the model
(fromrun.py, in front of this): a fork parts where its first live call is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtrace.serve.agents import agent_of
from kvtrace.serve.request import APIError

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from kvtrace.replay.backend import DiskFaults
    from kvtrace.serve.answerer import Answerer
    from kvtrace.serve.recording import Sink


def model_index(agent: int, num_models: int) -> int:
    """Which of the models answers agent `agent` (1-based)."""
    return (agent - 1) % num_models


class ModelNamed:
    """An upstream answerer whose requests name `name` as their model (module docstring)."""

    def __init__(self, inner: Answerer, name: str) -> None:
        self.inner = inner
        self.name = name

    @property
    def model(self) -> str | None:
        return self.name

    @property
    def required_model(self) -> str | None:
        return None

    @property
    def description(self) -> str:
        return f"{self.inner.description} as {self.name}"

    def health(self) -> dict[str, Any]:
        return {**self.inner.health(), "model": self.name}

    def take_cache_faults(self) -> DiskFaults | None:
        return None

    async def answer(self, request: Request, body: bytes, sink: Sink) -> Response:
        if request.method == "POST" and body:
            try:
                value = json.loads(body)
            except ValueError:
                value = None  # not JSON: the upstream answers it as it is
            if isinstance(value, dict) and "model" in value:
                body = json.dumps({**value, "model": self.name}).encode()
        return await self.inner.answer(request, body, sink)

    async def close(self) -> None:
        return None  # the shared upstream answerer is closed by `ByAgent`


class ByAgent:
    """Agent i's requests answered by `answerers[model_index(i, n)]` (module docstring)."""

    def __init__(self, answerers: Sequence[Answerer], *, shared: Answerer | None = None) -> None:
        if len(answerers) < 2:
            raise ValueError("ByAgent dispatches between two or more answerers")
        self.answerers = list(answerers)
        self._shared = shared  # the upstream answerer behind every `ModelNamed`

    @property
    def models(self) -> list[str | None]:
        return [answerer.model for answerer in self.answerers]

    def model_of(self, agent: int) -> str | None:
        return self.answerers[model_index(agent, len(self.answerers))].model

    @property
    def model(self) -> str | None:
        return ", ".join(str(model) for model in self.models)

    @property
    def required_model(self) -> str | None:
        return None

    @property
    def description(self) -> str:
        return "; ".join(answerer.description for answerer in self.answerers)

    def health(self) -> dict[str, Any]:
        return {"mode": "models", "models": [answerer.health() for answerer in self.answerers]}

    def take_cache_faults(self) -> DiskFaults | None:
        found = [faults for answerer in self.answerers
                 if (faults := answerer.take_cache_faults()) is not None]
        if not found:
            return None
        total = found[0]
        for faults in found[1:]:
            total = total.plus(faults)
        return total

    async def answer(self, request: Request, body: bytes, sink: Sink) -> Response:
        agent = agent_of(request)
        if agent is None:
            raise APIError(404, f"this server answers {len(self.answerers)} models, one per "
                           "agent, each agent at its own base URL: /a/1/v1 ... (docs/fork.md)",
                           code="not_found")
        return await self.answerers[model_index(agent.index, len(self.answerers))].answer(
            request, body, sink)

    async def close(self) -> None:
        for answerer in self.answerers:
            await answerer.close()
        if self._shared is not None:
            await self._shared.close()
