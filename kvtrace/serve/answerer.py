"""What answers `kvtrace serve`'s requests: one interface, two implementations.

The app (app.py) authorizes a `/v1/...` request, decides where it is
recorded (recording.py's sink), reads its body within the limit, and hands
all three to `Answerer.answer`; it never asks which answerer it has. The
modes are the answerers:

- `LocalAnswerer` (local.py): the engine answers `POST /v1/chat/completions`,
  `POST /v1/messages` (Anthropic) and `POST /v1/responses` (OpenAI
  Responses), and lists its one model at `GET /v1/models`; any other path is
  a 404;
- `UpstreamAnswerer` (upstream.py): every request goes on to the upstream
  (requests of the three APIs checked first) and comes back unchanged.

An answerer also says what `GET /health` shows of it, the model it answers
with, the one model name requests must name (`--strict-model`; the request
schemas' `model`, openapi.py), and a line naming it for the CLI's banner;
`close` runs when the server stops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from kvtrace.replay.backend import DiskFaults
    from kvtrace.serve.recording import Sink


class Answerer(Protocol):
    """The server's answering half (see the module docstring)."""

    @property
    def model(self) -> str | None:
        """The model that answers (local), or None when requests go on to the upstream."""

    @property
    def required_model(self) -> str | None:
        """The one model name a request may name (else a 404), or None: any name."""

    @property
    def description(self) -> str:
        """What answers, for a person: "local model NAME", "upstream URL"."""

    def health(self) -> dict[str, Any]:
        """This answerer's fields of `GET /health` (`mode` and what the mode has)."""

    def take_cache_faults(self) -> DiskFaults | None:
        """What the local engine's disk tier recovered from since last asked (None: no local
        engine), for the closing line of `serve` and `record`."""

    async def answer(self, request: Request, body: bytes, sink: Sink) -> Response:
        """The response to an authorized `/v1/...` request whose body was read; its step
        goes to `sink`. Bad input raises request.py's `APIError` before anything is recorded."""

    async def close(self) -> None:
        """Free what the answerer holds (threads, connections); the server has stopped."""
