"""The local answerer: the engine answers chat requests, one at a time, through a bounded queue.

`LocalAnswerer.answer` serves `POST /v1/chat/completions` and `GET
/v1/models` (the one model it serves); any other path is a 404.

A request is prepared off the event loop, on one "prepare" thread: its body
parsed and checked (api.py), its model checked, its prompt tokenised. A
prompt whose text alone takes more bytes than the context's tokens can
cover (`context x the longest token's bytes`) is refused before it is
tokenised, so a 15 MB prompt costs no tokenisation at all.

The one engine computes one request at a time on one worker thread (the
engine and its KV cache are not thread-safe, and two requests at once would
each run at half speed anyway). Requests wait in a queue of `max_queue`;
past it the server answers 429 at once, never queues without bound. A
request whose client leaves is cancelled (disconnect.py): the engine skips
it if it has not started, or stops at its next decode step, and nothing is
recorded (`/health` counts them: `queue.cancelled`). It stays counted in the
queue until the engine has let it go, so the queue never holds more work
than it says. Each
request goes through replay's `LocalBackend`, so the prefix cache (memory
then disk) serves every prefix an earlier request or replay computed:
`usage.prompt_tokens_details.cached_tokens` is what it reused (the
prompt's last token is always computed).

Rendering: `engine.chat_tokens(messages, tools=...)` (kvtrace/rendering.py:
the model's template when it renders tools, else the documented fallback),
and the generated text is parsed back into `content` and `tool_calls` with
`parse_assistant_text` when the request offers tools (and `tool_choice` is
not "none"). Sampling is greedy unless the request sets `temperature > 0`
(then a random seed is chosen when none is given, and recorded so `replay
--mode verify` can reproduce it). `stop` strings cut the text after
generation. Local streaming sends the answer as SSE once it is generated:
the engine has no per-token callback; it is recorded just before its `data:
[DONE]` event is sent, so a client that has read a whole stream finds it in
the store, and a stream the client drops is recorded marked incomplete.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvtrace.errors import GenerationCancelledError, UsageError
from kvtrace.replay.backend import CallRequest, SamplingParams
from kvtrace.serve.api import CHAT_PATH, MODELS_PATH, APIError, ChatRequest, parse_chat_request
from kvtrace.serve.disconnect import ClosingStream, client_left, unless_client_leaves
from kvtrace.serve.recording import Sink, StepWrite
from kvtrace.store.kinds import TOKEN_IDS_KEY
from kvtrace.tracer import sse

if TYPE_CHECKING:
    from kvtrace.replay.local import LocalBackend
    from kvtrace.store import Step
    from kvtrace.tracer.recorder import Recorder
    from kvtrace.tracer.redact import Redactor

DEFAULT_MAX_TOKENS = 256  # replay's default too, so an unset max_tokens replays alike


@dataclass(frozen=True, slots=True)
class LocalAnswer:
    """A completion and what to record with it."""

    completion: dict[str, Any]
    params: dict[str, Any]
    usage: dict[str, Any]
    timings: dict[str, float]
    is_seed_chosen: bool

    def step(self, request: ChatRequest, url: str, *, is_complete: bool = True) -> StepWrite:
        """How this answer to `request` (sent to `url`) is recorded: a model_call step."""
        completion = self.completion

        def write(recorder: Recorder, redactor: Redactor) -> Step:
            extra: dict[str, Any] = {
                "http": {"url": redactor.url(url), "status": 200, "stream": request.is_stream,
                         "complete": is_complete},
                "response": {"id": completion["id"], "created": completion["created"]},
                "served_by": "kvtrace serve (local)",
            }
            if self.is_seed_chosen:
                extra["seed_chosen"] = True
            return recorder.record_model_call(
                request.messages, completion, model=completion["model"], tools=request.tools,
                params=redactor.fields(self.params), usage=self.usage, timings=self.timings,
                extra=extra)

        return write


class LocalAnswerer:
    """The engine behind the server: queue, prompt checks, generation, completion."""

    def __init__(self, backend: LocalBackend, *, max_queue: int = 16) -> None:
        if max_queue < 0:
            raise UsageError(f"max_queue must be >= 0, not {max_queue}")
        # Each answer's output is stored before the reply: the next request
        # may come from another client, or never, and `cached_tokens` must
        # count only KV the cache held (no deferred output, see replay/local.py).
        self._backend = backend.storing_output()
        self._capacity = max_queue + 1  # the one running, and those waiting
        self._in_flight = 0
        self._num_cancelled = 0
        self._max_prompt_bytes = _max_prompt_bytes(backend.engine)
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="kvtrace-prepare")
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvtrace-engine")

    @property
    def model(self) -> str:
        return self._backend.model

    @property
    def description(self) -> str:
        return f"local model {self.model}"

    @property
    def queue(self) -> dict[str, int]:
        running = min(self._in_flight, 1)
        return {"running": running, "waiting": self._in_flight - running,
                "capacity": self._capacity, "cancelled": self._num_cancelled}

    def health(self) -> dict[str, Any]:
        return {"mode": "local", "model": self.model, "queue": self.queue}

    async def close(self) -> None:
        self._preparer.shutdown(wait=True)
        self._worker.shutdown(wait=True)

    async def answer(self, request: Request, body: bytes, sink: Sink) -> Response:
        """A chat completion, or the model list; any other path is a 404."""
        route = (request.method, request.url.path)
        if route == ("GET", MODELS_PATH):
            return JSONResponse({"object": "list", "data": [{
                "id": self.model, "object": "model", "created": 0, "owned_by": "kvtrace"}]})
        if route != ("POST", CHAT_PATH):
            raise APIError(404, f"{request.method} {request.url.path} is not served in local "
                           f"mode (POST {CHAT_PATH}, GET {MODELS_PATH})", code="not_found")
        loop = asyncio.get_running_loop()
        chat, prompt = await loop.run_in_executor(self._preparer, self.prepare, body)
        reply = await self._queued(request, chat, prompt)
        url = str(request.url)
        if not chat.is_stream:
            await sink.record(reply.step(chat, url))
            return JSONResponse(reply.completion)

        async def events() -> AsyncIterator[bytes]:
            is_recorded = False
            try:
                for event in sse.stream_events(reply.completion,
                                               include_usage=chat.includes_usage):
                    if event.startswith(b"data: " + sse.DONE):
                        is_recorded = True  # before the wait: the write goes on if we are
                        await sink.record(reply.step(chat, url))  # cancelled meanwhile
                    yield event
            finally:
                if not is_recorded:  # the client left early: the answer, marked incomplete
                    sink.record_later(reply.step(chat, url, is_complete=False))

        return ClosingStream(events(), media_type="text/event-stream")

    def prepare(self, body: bytes) -> tuple[ChatRequest, list[int]]:
        """The checked request and its prompt's token ids (on the prepare thread)."""
        chat = parse_chat_request(body, is_local=True)
        return chat, self.check(chat)

    def check(self, request: ChatRequest) -> list[int]:
        """The prompt's token ids, after the checks that do not need the engine's time."""
        if request.model != self.model:
            raise APIError(404, f"the model {request.model!r} does not exist here: this server "
                           f"serves {self.model!r} (GET /v1/models)", param="model",
                           code="model_not_found")
        engine = self._backend.engine
        limit = engine.max_context_tokens
        text_bytes = _text_bytes(request.messages)
        if self._max_prompt_bytes is not None and text_bytes > self._max_prompt_bytes:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                           f"messages hold {text_bytes:,} bytes of text, more than {limit} "
                           "tokens can hold: shorten them", param="messages",
                           code="context_length_exceeded")
        try:
            prompt = engine.chat_tokens(request.messages, tools=request.tools)
        except UsageError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
        if limit is not None and len(prompt) >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                           f"messages take {len(prompt)}: shorten them", param="messages",
                           code="context_length_exceeded")
        return prompt

    async def _queued(self, client: Request, request: ChatRequest,
                      prompt: list[int]) -> LocalAnswer:
        """Queue for the engine (429 when the queue is full), then generate; cancelled when
        the client leaves (the module docstring)."""
        if self._in_flight >= self._capacity:
            raise APIError(429, f"the server is busy: {self._capacity - 1} requests already "
                           "wait for the engine; retry later", kind="rate_limit_error",
                           code="rate_limit_exceeded")
        self._in_flight += 1
        cancelled = threading.Event()
        try:
            loop = asyncio.get_running_loop()
            job = loop.run_in_executor(self._worker, self._generate, request, prompt,
                                       cancelled)
            return await unless_client_leaves(client, job, stop=cancelled.set)
        finally:
            self._in_flight -= 1
            if cancelled.is_set():
                self._num_cancelled += 1

    def _generate(self, request: ChatRequest, prompt: list[int],
                  cancelled: threading.Event) -> LocalAnswer:
        if cancelled.is_set():  # its client left while it waited: the engine never starts it
            raise client_left()
        body = request.body
        limit = self._backend.engine.max_context_tokens
        max_new = request.max_tokens or DEFAULT_MAX_TOKENS
        if limit is not None:
            max_new = max(1, min(max_new, limit - len(prompt)))
        temperature = float(body.get("temperature") or 0.0)
        params = SamplingParams(
            temperature=temperature,
            top_p=float(body.get("top_p") or 1.0),
            seed=body.get("seed") if temperature > 0 else None,
            max_new_tokens=max_new,
        )
        started = time.perf_counter()
        try:
            result = self._backend.generate(CallRequest(list(request.messages), prompt, params),
                                            is_cancelled=cancelled.is_set)
        except GenerationCancelledError:
            # not chained: its traceback holds the decoding's frames and their KV tensors,
            # which would then live as long as this error and the futures that carry it
            raise client_left() from None
        text, finish = result.text, result.finish_reason
        for stop in request.stop:
            if stop and stop in text:
                text, finish = text[: text.index(stop)], "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if request.parses_tool_calls:
            from kvtrace.rendering import id_seed, parse_assistant_text

            message = parse_assistant_text(text, id_seed=id_seed(request.messages))
            if message.get("tool_calls"):
                finish = "tool_calls"
        completion_tokens = len(result.output_ids or [])
        usage: dict[str, Any] = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": result.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.reused_tokens or 0},
        }
        completion = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": usage,
        }
        recorded_params = {k: v for k, v in body.items()
                           if k not in ("messages", "tools", "model", "stream", "stream_options")}
        is_seed_chosen = temperature > 0 and body.get("seed") is None and result.seed is not None
        if is_seed_chosen:
            recorded_params["seed"] = result.seed
        recorded_usage = {
            **usage,
            "cached_tokens": result.reused_tokens,
            "finish_reason": finish,
            TOKEN_IDS_KEY: list(result.output_ids or []),
        }
        timings = {"total_s": round(time.perf_counter() - started, 6),
                   "prefill_s": round(result.prefill_s, 6), "decode_s": round(result.decode_s, 6)}
        return LocalAnswer(completion, recorded_params, recorded_usage, timings, is_seed_chosen)


def _max_prompt_bytes(engine: Any) -> int | None:
    """Bytes of message text past which a prompt cannot fit the context, whatever its tokens.

    No token covers more bytes of text than the longest vocabulary entry
    spells (counted in UTF-8: byte-level entries spell a byte with up to
    two, SentencePiece's "▁" a space with three), so text of more than
    `context x longest` bytes needs more tokens than the context has. Twice
    that, for tokenizers whose normalizer shortens text before it is split.
    """
    limit = engine.max_context_tokens
    vocab = getattr(engine.tokenizer, "get_vocab", None)
    if limit is None or vocab is None:
        return None
    longest = max((len(token.encode("utf-8", "replace")) for token in vocab()), default=0)
    return 2 * limit * longest if longest else None


def _text_bytes(messages: list[dict[str, Any]]) -> int:
    """UTF-8 bytes of the messages' text (string content and text parts), which any chat
    template renders: a lower bound of the prompt's length."""
    total = 0
    for message in messages:
        content = message.get("content")
        parts = content if isinstance(content, list) else [{"text": content}]
        for part in parts:
            text = part.get("text")
            if isinstance(text, str):
                total += len(text.encode("utf-8"))
    return total
