"""`kvtrace serve`: an OpenAI-compatible server that records every call into a run.

Routes: `POST /v1/chat/completions` (plain and SSE streaming, tools),
`GET /v1/models`, `GET /health`, `GET /openapi.json` (openapi.py); in upstream
mode every other `/v1/...` request is forwarded too (and recorded as an http step).

- **local** (`answerer`): the engine with its prefix cache answers (local.py).
- **upstream** (`upstream="http://host:port/v1"`): the request goes on with
  httpx, and the upstream's status, headers (less hop-by-hop ones) and body
  bytes come back unchanged, streamed as they arrive. The client's
  Authorization goes along, unless the server has its own `api_key` (then it
  is dropped) or an `upstream_api_key` (then that is sent instead).

Each call is recorded into the run the `X-Kvtrace-Run` header names, else
the server's `run`, else a run named at start (`serve-YYYYMMDD-HHMMSS`).
What is recorded is exchange.py's model_call (or http) step, secrets
redacted. Bad input (malformed JSON, wrong types, unknown model, a prompt
past the context, a body over `max_body_bytes`, a missing or wrong bearer
token) is a 4xx with an OpenAI-style error body, and nothing is recorded; so
is a 4xx the upstream answers. A full local queue is a 429. Store writes run
on one worker thread, so the event loop never waits on the database; a
streamed answer is recorded just before its `data: [DONE]` event is sent, so
a client that has read a whole stream finds it in the store.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtrace.errors import UsageError
from kvtrace.store import Step, Store, validate_run_name
from kvtrace.tracer import sse
from kvtrace.tracer.api import APIError, ChatRequest, parse_chat_request
from kvtrace.tracer.exchange import Exchange, decoded_body, record_exchange
from kvtrace.tracer.local import LocalAnswer, LocalAnswerer
from kvtrace.tracer.openapi import chat_operation
from kvtrace.tracer.recorder import Recorder
from kvtrace.tracer.redact import Redactor

T = TypeVar("T")
RUN_HEADER = "x-kvtrace-run"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
    "upgrade", "host", "content-length",
})
_NOT_RETURNED = frozenset({"connection", "keep-alive", "transfer-encoding", "date", "server"})


@dataclass(slots=True)
class RunStats:
    """What a server recorded into one run (for `kvtrace record`'s summary)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    unknown_cached: int = 0  # calls whose server did not report cached tokens
    other_steps: int = 0

    def add(self, step: Step) -> None:
        if step.kind != "model_call":
            self.other_steps += 1
            return
        usage = step.meta.get("usage") or {}
        self.calls += 1
        self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.completion_tokens += int(usage.get("completion_tokens") or 0)
        if usage.get("cached_tokens") is None:
            self.unknown_cached += 1
        else:
            self.cached_tokens += int(usage["cached_tokens"])


@dataclass(slots=True)
class ChatServer:
    """The server's state; `app` is the ASGI application (see the module docstring)."""

    store: Store
    answerer: LocalAnswerer | None = None
    upstream: str | None = None
    run: str | None = None
    api_key: str | None = None
    upstream_api_key: str | None = None
    redact_headers: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    is_recording: bool = True
    stats: dict[str, RunStats] = field(default_factory=dict)
    default_run: str = field(init=False)
    app: FastAPI = field(init=False)
    _redactor: Redactor = field(init=False)
    _recorders: dict[str, Recorder] = field(init=False, default_factory=dict)
    _store_worker: ThreadPoolExecutor = field(init=False)
    _client: httpx.AsyncClient | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if (self.answerer is None) == (self.upstream is None):
            raise UsageError("kvtrace serve answers either locally or from --upstream URL")
        if self.upstream is not None:
            if not self.upstream.startswith(("http://", "https://")):
                raise UsageError(f"--upstream {self.upstream!r} must start with http:// or "
                                 "https:// and end with the API prefix (often /v1)")
            self.upstream = self.upstream.rstrip("/")
        self.default_run = (
            validate_run_name(self.run) if self.run is not None else new_run_name(self.store)
        )
        self._redactor = Redactor(self.redact_headers)
        self._store_worker = ThreadPoolExecutor(1, thread_name_prefix="kvtrace-store")
        self.app = self._build_app()

    @property
    def mode(self) -> str:
        return "local" if self.answerer is not None else "upstream"

    # -- the application -----------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            if self.upstream is not None:
                self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))
            try:
                yield
            finally:
                if self._client is not None:
                    await self._client.aclose()
                self._store_worker.shutdown(wait=True)

        app = FastAPI(title="kvtrace serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                      openapi_url="/openapi.json")
        model = self.answerer.model_name if self.answerer is not None else None

        @app.exception_handler(APIError)
        async def api_error(_: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                             code="not_found" if exc.status_code == 404 else None)
            return JSONResponse(error.body(), status_code=exc.status_code)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            info: dict[str, Any] = {"status": "ok", "mode": self.mode, "run": self.default_run}
            if self.answerer is not None:
                info["model"] = self.answerer.model_name
                info["queue"] = self.answerer.queue
            else:
                info["upstream"] = self.upstream
            return info

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            self._authorize(request)
            if self.answerer is None:
                return await self._forward(request, b"", run=None)
            return JSONResponse({"object": "list", "data": [{
                "id": self.answerer.model_name, "object": "model", "created": 0,
                "owned_by": "kvtrace",
            }]})

        @app.post("/v1/chat/completions", openapi_extra=chat_operation(model))
        async def chat(request: Request) -> Response:
            self._authorize(request)
            run = self._run_for(request)
            data = await self._body(request)
            chat = parse_chat_request(data, is_local=self.answerer is not None)
            if self.answerer is None:
                return await self._forward(request, data, run=run)
            return await self._answer_locally(request, chat, run)

        async def other(request: Request, path: str) -> Response:
            self._authorize(request)
            if self.answerer is not None:
                raise APIError(404, f"{request.method} /v1/{path} is not served in local mode "
                               "(POST /v1/chat/completions, GET /v1/models)", code="not_found")
            run = self._run_for(request)
            return await self._forward(request, await self._body(request), run=run)

        for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):  # one operationId each
            app.add_api_route("/v1/{path:path}", other, methods=[method],
                              operation_id=f"forward_{method.lower()}")
        return app

    # -- checks --------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            what = "no bearer token was sent" if not given else "the bearer token is wrong"
            raise APIError(401, f"{what}: send 'Authorization: Bearer KEY' with the key "
                           "kvtrace serve was started with (--api-key)",
                           code="invalid_api_key")

    def _run_for(self, request: Request) -> str:
        name = request.headers.get(RUN_HEADER)
        if name is None:
            return self.default_run
        try:
            return validate_run_name(name)
        except UsageError as exc:
            raise APIError(400, f"header X-Kvtrace-Run: {exc}", param=RUN_HEADER,
                           code="invalid_value") from exc

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

    # -- recording -----------------------------------------------------------------------

    def _recorder(self, run: str) -> Recorder:
        recorder = self._recorders.get(run)
        if recorder is None:
            recorder = self._recorders[run] = Recorder(self.store.run(run))
        return recorder

    def _write(self, run: str, write: Callable[[Recorder], Step]) -> Step:
        step = write(self._recorder(run))
        self.stats.setdefault(run, RunStats()).add(step)
        return step

    async def _in_store(self, run: str, write: Callable[[Recorder], Step]) -> None:
        if self.is_recording:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._store_worker, self._write, run, write)

    def _record_later(self, run: str, write: Callable[[Recorder], Step]) -> None:
        """Record without waiting (a stream the client dropped: nobody waits for it)."""
        if self.is_recording:
            self._store_worker.submit(self._write, run, write)

    # -- local mode ----------------------------------------------------------------------

    async def _answer_locally(self, request: Request, chat: ChatRequest, run: str) -> Response:
        if self.answerer is None:
            raise RuntimeError("local answers need the engine")
        prompt = self.answerer.check(chat)
        answer = await self.answerer.answer(chat, prompt)
        url = self._redactor.url(str(request.url))
        model = self.answerer.model_name

        def write(recorder: Recorder, *, complete: bool = True) -> Step:
            return recorder.record_model_call(
                chat.messages, answer.completion, model=model,
                tools=chat.tools, params=answer.params, usage=answer.usage,
                timings=answer.timings,
                extra=_local_extra(answer, url, chat.is_stream, complete=complete),
            )

        if not chat.is_stream:
            await self._in_store(run, write)
            return JSONResponse(answer.completion)

        async def events() -> AsyncIterator[bytes]:
            is_recorded = False
            try:
                for event in sse.stream_events(answer.completion,
                                               include_usage=chat.includes_usage):
                    if event.startswith(b"data: " + sse.DONE):
                        await self._in_store(run, write)
                        is_recorded = True
                    yield event
            finally:
                if not is_recorded:  # the client left early: the answer, marked incomplete
                    self._record_later(run, lambda recorder: write(recorder, complete=False))

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- upstream mode -------------------------------------------------------------------

    async def _forward(self, request: Request, body: bytes, *, run: str | None) -> Response:
        if self.upstream is None or self._client is None:
            raise RuntimeError("forwarding needs the upstream client (started with the app)")
        prefix = "/v1"
        path = request.url.path[len(prefix):] if request.url.path.startswith(prefix) else (
            request.url.path)
        url = self.upstream + path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items()
                   if k.lower() not in _HOP_BY_HOP and k.lower() != RUN_HEADER]
        if self.api_key is not None or self.upstream_api_key is not None:
            headers = [(k, v) for k, v in headers if k.lower() != "authorization"]
            if self.upstream_api_key is not None:
                headers.append(("authorization", f"Bearer {self.upstream_api_key}"))
        started = time.perf_counter()
        upstream_request = self._client.build_request(request.method, url, headers=headers,
                                                      content=body)
        try:
            response = await self._client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            raise APIError(502, f"cannot reach the upstream {self.upstream} ({exc}): is it "
                           "running, and does --upstream end with its API prefix (often /v1)?",
                           kind="api_error", code="upstream_unreachable") from exc
        returned = {k: v for k, v in response.headers.items() if k.lower() not in _NOT_RETURNED}
        is_recorded = run is not None and not 400 <= response.status_code < 500

        def exchange(raw: bytes, first_byte_s: float | None, complete: bool) -> Exchange:
            return Exchange(
                method=request.method, url=url,
                request_headers=tuple(request.headers.items()), request_body=body,
                status=response.status_code,
                response_headers=tuple(response.headers.multi_items()),
                response_body=decoded_body(response.headers, raw), is_complete=complete,
                total_s=time.perf_counter() - started, first_byte_s=first_byte_s,
            )

        def write_of(item: Exchange) -> Callable[[Recorder], Step]:
            return lambda recorder: record_exchange(recorder, item, self._redactor)

        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
        if not is_sse:
            try:
                raw = b"".join([chunk async for chunk in response.aiter_raw()])
            finally:
                await response.aclose()
            if is_recorded and run is not None:
                await self._in_store(run, write_of(exchange(raw, None, True)))
            return Response(raw, status_code=response.status_code, headers=returned)

        async def relay() -> AsyncIterator[bytes]:
            chunks: list[bytes] = []
            first_byte_s: float | None = None
            is_done = False
            try:
                async for chunk in response.aiter_raw():
                    if first_byte_s is None:
                        first_byte_s = time.perf_counter() - started
                    chunks.append(chunk)
                    if not is_done and chunk.rstrip().endswith(b"[DONE]"):
                        is_done = True
                        if is_recorded and run is not None:
                            await self._in_store(
                                run, write_of(exchange(b"".join(chunks), first_byte_s, True)))
                    yield chunk
                if not is_done and is_recorded and run is not None:
                    is_done = True
                    await self._in_store(
                        run, write_of(exchange(b"".join(chunks), first_byte_s, True)))
            finally:
                await response.aclose()
                if not is_done and is_recorded and run is not None:
                    self._record_later(run, write_of(exchange(b"".join(chunks), first_byte_s,
                                                              False)))

        return StreamingResponse(relay(), status_code=response.status_code, headers=returned)


def _local_extra(answer: LocalAnswer, url: str, is_stream: bool, *,
                 complete: bool) -> dict[str, Any]:
    completion = answer.completion
    extra: dict[str, Any] = {
        "http": {"url": url, "status": 200, "stream": is_stream, "complete": complete},
        "response": {"id": completion["id"], "created": completion["created"]},
        "served_by": "kvtrace serve (local)",
    }
    if answer.is_seed_chosen:
        extra["seed_chosen"] = True
    return extra


def new_run_name(store: Store, prefix: str = "serve") -> str:
    """A run name no run has yet: PREFIX-YYYYMMDD-HHMMSS (UTC), with -N appended if taken."""
    base = f"{prefix}-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    taken = {info.name for info in store.runs()}
    name, number = base, 1
    while name in taken:
        number += 1
        name = f"{base}-{number}"
    return name
