"""`kvtrace serve`'s ASGI application: routes, checks, errors; answering is the answerer's.

Routes: `POST /v1/chat/completions`, `POST /v1/messages` (Anthropic),
`POST /v1/responses` (OpenAI Responses), `GET /v1/models`, every other
`/v1/...` path, `POST /tokenize` (vLLM's, local mode: a 404 upstream, where
the upstream's own answers), `GET /health`, `GET /openapi.json` (openapi.py). A `/v1`
request is authorized (a bearer token, when the server has an `api_key`),
its sink is chosen (recording.py: the run it names, or nothing recorded),
its body is read up to `max_body_bytes`, and the answerer (answerer.py:
local.py's engine or upstream.py's forwarder) answers it; `GET /v1/models`
records nothing. The app holds no mode of its own (but that 404): what
differs between the modes is in the answerers.

Bad input (malformed JSON, wrong types, a prompt past the context, a body
over `max_body_bytes`, a missing or wrong bearer token) is a 4xx with an
error body in the shape of the API the path belongs to (request.py's
`APIError`: OpenAI's `{"error": {...}}`, or Anthropic's `{"type": "error",
"error": {...}}` under `/v1/messages`), and nothing is recorded. Anything else
that fails while a request is answered (the store's database gone, a bug)
is a 500 with the same kind of body, logged once with its traceback: an
exception left to the ASGI server would be a plain-text 500 that also
closes the client's kept-alive connection (a stream under way ends with
that error as an SSE event instead, the answerers' part). When the server stops, the
answerer is closed and the store writes still queued are waited for.

A WebSocket upgrade on `/v1/responses` (Codex tries one first, to speak
the Responses API over a socket) is answered `426 Upgrade Required` with an
OpenAI error body, before any work: Codex then falls back to HTTP, which
the server answers. Upgrades elsewhere are refused as Starlette does (403).

Authentication: with an `api_key`, every `/v1` request needs `Authorization:
Bearer KEY`, or Anthropic's `x-api-key: KEY` (401 otherwise); `GET /health`
and `GET /openapi.json` stay open, as they describe the server and hold
nothing recorded. A key is visible ASCII without spaces (what a bearer
token is made of, RFC 6750): an empty key, or one with a space, would
accept an empty token or never match, so `check_api_key` refuses it when
the server is made.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from kvtrace.errors import UsageError
from kvtrace.serve.agents import Agent, AgentRoutes
from kvtrace.serve.answerer import Answerer
from kvtrace.serve.anthropic_api import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    error_body,
    is_anthropic_path,
)
from kvtrace.serve.api import CHAT_PATH, DETOKENIZE_PATH, MODELS_PATH, TOKENIZE_PATH
from kvtrace.serve.openapi import chat_operation, messages_operation, responses_operation
from kvtrace.serve.recording import DISCARD, Recording, RunStats
from kvtrace.serve.request import APIError, check_content_type, failed_answer
from kvtrace.serve.responses_api import RESPONSES_PATH

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
JSON_PATHS = frozenset({CHAT_PATH, MESSAGES_PATH, COUNT_TOKENS_PATH, RESPONSES_PATH,
                        TOKENIZE_PATH, DETOKENIZE_PATH})
UPGRADE_REQUIRED = 426
# POSTs that are no model call: nothing is recorded of them, so no snapshot is taken.
NOT_CALLS = frozenset({COUNT_TOKENS_PATH, TOKENIZE_PATH, DETOKENIZE_PATH})


class ChatServer:
    """An answerer and a recording behind one ASGI application, `app`."""

    def __init__(self, answerer: Answerer, recording: Recording, *, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 agents: Sequence[Agent] = ()) -> None:
        self.answerer = answerer
        self.recording = recording
        self.api_key = check_api_key(api_key)
        self.max_body_bytes = max_body_bytes
        self.agents = tuple(agents)
        routes = self._build_app()
        # K agents (agents.py): /a/i/... is /... asked by agent i
        self.app: ASGIApp = AgentRoutes(routes, self.agents) if self.agents else routes

    @property
    def default_run(self) -> str:
        return self.recording.default_run

    @property
    def stats(self) -> dict[str, RunStats]:
        """What was recorded into each run so far."""
        return self.recording.stats

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            try:
                yield
            finally:
                await self.answerer.close()
                self.recording.close()

        app = FastAPI(title="kvtrace serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                      openapi_url="/openapi.json")

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError) -> JSONResponse:
            return error_response(request.url.path, exc)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                             code="not_found" if exc.status_code == 404 else None)
            return error_response(request.url.path, error)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "run": self.default_run, **self.answerer.health()}

        @app.get(MODELS_PATH)
        async def models(request: Request) -> Response:
            self._authorize(request)
            return await self.answerer.answer(request, b"", DISCARD)

        required_model = self.answerer.required_model
        is_local = self.answerer.model is not None

        @app.post(CHAT_PATH, openapi_extra=chat_operation(required_model, is_local=is_local))
        async def chat(request: Request) -> Response:
            return await self._answer(request)

        @app.post(MESSAGES_PATH, openapi_extra=messages_operation(required_model))
        async def messages(request: Request) -> Response:
            return await self._answer(request)

        @app.post(RESPONSES_PATH, openapi_extra=responses_operation(required_model,
                                                                    is_local=is_local))
        async def responses(request: Request) -> Response:
            return await self._answer(request)

        @app.websocket(RESPONSES_PATH)
        async def responses_socket(websocket: WebSocket) -> None:
            """Codex's WebSocket transport: refused with a 426, so it falls back to HTTP."""
            error = APIError(UPGRADE_REQUIRED, "kvtrace serve answers the Responses API over "
                             f"HTTP only: send POST {RESPONSES_PATH} (no WebSocket)",
                             code="upgrade_required")
            if "websocket.http.response" in websocket.scope.get("extensions", {}):
                await websocket.send_denial_response(
                    JSONResponse(error.body(), status_code=UPGRADE_REQUIRED))
            else:  # an ASGI server without denial responses: a plain refusal (403)
                await websocket.close(code=1008, reason=error.message[:120])

        @app.post(TOKENIZE_PATH, include_in_schema=False)
        @app.post(DETOKENIZE_PATH, include_in_schema=False)
        async def tokenize(request: Request) -> Response:
            if not is_local:
                raise APIError(404, f"POST {request.url.path} is served in local mode only: "
                               "ask the upstream server's own", code="not_found")
            return await self._answer(request)

        async def other(request: Request, path: str) -> Response:
            return await self._answer(request)

        for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):  # one operationId each
            app.add_api_route("/v1/{path:path}", other, methods=[method],
                              operation_id=f"forward_{method.lower()}")
        return app

    async def _answer(self, request: Request) -> Response:
        try:
            return await self._answer_checked(request)
        except (APIError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the module docstring: a JSON 500, the connection kept
            raise failed_answer(request.method, request.url.path, exc) from exc

    async def _answer_checked(self, request: Request) -> Response:
        self._authorize(request)
        sink = self.recording.sink(request)
        if request.method == "POST" and request.url.path in JSON_PATHS:
            check_content_type(request.headers.get("content-type"))
        body = await self._body(request)
        await sink.check_open()
        if request.method == "POST" and request.url.path not in NOT_CALLS:
            await sink.snapshot()  # a call: its step names the folder as it was now
        return await self.answerer.answer(request, body, sink)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's SDKs send the key as x-api-key
            token = request.headers.get("x-api-key", "")
            given = given or token
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            what = "no bearer token was sent" if not given else "the bearer token is wrong"
            raise APIError(401, f"{what}: send 'Authorization: Bearer KEY' (or 'x-api-key: "
                           "KEY') with the key kvtrace serve was started with (--api-key)",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        too_big = APIError(413, f"the request body is over the {limit}-byte limit "
                           "(kvtrace serve --max-body-bytes)", code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)


def error_response(path: str, error: APIError) -> JSONResponse:
    """`error` as a JSON response in the shape of the API `path` belongs to."""
    body = error_body(error) if is_anthropic_path(path) else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers or None)


def check_api_key(key: str | None, name: str = "api_key") -> str | None:
    """`key` when it can be a bearer token (module docstring), else UsageError naming `name`."""
    if key is None:
        return None
    if not key:
        raise UsageError(f"{name} is empty: give the key clients must send, or leave {name} "
                         "out to serve without one")
    if not all("!" <= char <= "~" for char in key):
        raise UsageError(f"{name} must be visible ASCII characters without spaces (a bearer "
                         "token); this one has a space, a control or a non-ASCII character")
    return key
