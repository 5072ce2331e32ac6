"""The local answerer: the engine answers three APIs, decoding the requests in flight together.

`LocalAnswerer.answer` serves `POST /v1/chat/completions`, `POST
/v1/messages` (Anthropic) and `POST /v1/responses` (OpenAI Responses), `GET
/v1/models` (the one model it serves), `POST /v1/messages/count_tokens`
(the rendered prompt's length) and `POST /tokenize` (a chat request's prompt
ids, in vLLM's shape); any other path is a 404. Each
API checks its own request and writes its own answer (`DIALECTS`:
api.py and chat_reply.py, anthropic_api.py, responses_api.py); everything
between, described here, is shared, so the three APIs get the same queue,
cache, rendering and guarantees.

Any model name is answered by the local model (an agent names the model it
was written for); the step records the name asked for (`extra.
request_model`) beside the model that answered. With `strict_model` a
request naming another model is a 404 (`model_not_found`), as before.

A request is prepared off the event loop, on one "prepare" thread: its body
parsed and checked, its prompt tokenised. A prompt whose text alone takes
more bytes than the context's tokens can cover (`context x the longest
token's bytes`) is refused before it is tokenised, so a 15 MB prompt costs
no tokenisation at all.

The one engine decodes the requests in flight together
(`kvtrace.engine.batch.DecodeBatcher`, docs/batching.md): one engine thread
owns the engine and its KV cache, prefills each request as it arrives and
runs one forward per token for all of them (up to 16; more wait for a
place), and each request gets exactly the tokens it gets alone. The server
holds at most `max_queue + 1` requests at once, decoded or waiting for a
place; past that it answers 429 at once, never queues without bound. A
request whose client leaves is cancelled (disconnect.py): the engine skips
it if it has not started, or stops at its next decode step, and nothing is
recorded (`/health` counts them: `queue.cancelled`). It stays counted until
the engine has let it go, so the server never holds more work than it says.
The answerer has the engine thread give the heap's freed pages back between
its work (engine/heap.py's `HeapTrimmer`: otherwise the freed pages transient
tensors leave around the memory tier's KV stay resident, and RSS grows for
as long as the server runs). Each
request goes through replay's `LocalBackend`, so the prefix cache (memory
then disk) serves every prefix an earlier request or replay computed, in
any of the three APIs: each answer's usage reports what it reused (the
prompt's last token is always computed). An answer's output is owed to the
cache, not stored before the reply (`LocalBackend.owing_output`): a later
prompt that holds it computes it in its own forward and reports it
computed, and one that never does never pays for it.

How a request is rendered (the model's template, or the documented fallback
when it renders no tools), sampled (greedy unless it sets a temperature;
the seed then recorded), stopped and streamed (the answer's events once it
is generated, recorded just before the last one) is in docs/serve.md.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvtrace.errors import GenerationCancelledError, UsageError
from kvtrace.replay import SamplingParams
from kvtrace.replay.backend import CallRequest
from kvtrace.serve.agents import agent_of
from kvtrace.serve.anthropic_api import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    MessagesReply,
    parse_messages_request,
    stream_error_event,
)
from kvtrace.serve.api import (
    CHAT_PATH,
    DETOKENIZE_PATH,
    MODELS_PATH,
    TOKENIZE_PATH,
    detokenize_request,
    model_list,
    parse_chat_request,
    tokenize_request,
)
from kvtrace.serve.chat_reply import ChatReply
from kvtrace.serve.disconnect import ClosingStream, client_left, unless_client_leaves
from kvtrace.serve.generation import Generation, LocalCall, Reply
from kvtrace.serve.recording import Sink
from kvtrace.serve.request import APIError, check_text_only, failed_answer
from kvtrace.serve.responses_api import RESPONSES_PATH, ResponsesReply, parse_responses_request

if TYPE_CHECKING:
    from kvtrace.replay.backend import DiskFaults
    from kvtrace.replay.local import LocalBackend

DEFAULT_MAX_TOKENS = 256  # replay's default too, so an unset max_tokens replays alike


@dataclass(frozen=True, slots=True)
class Dialect:
    """One API the engine answers: how its request is checked, how its answer is written."""

    parse: Callable[[bytes], Any]  # the body -> the API's LocalCall, or APIError
    reply: Callable[..., Reply]  # (call, generation, model=NAME) -> the API's Reply


DIALECTS = {
    CHAT_PATH: Dialect(lambda data: parse_chat_request(data, is_local=True), ChatReply),
    MESSAGES_PATH: Dialect(parse_messages_request, MessagesReply),
    RESPONSES_PATH: Dialect(lambda data: parse_responses_request(data, is_local=True),
                            ResponsesReply),
}
# /tokenize (api.py): a chat completions body (no max_tokens needed), less its
# add_generation_prompt (`_generation_prompt`).
TOKENIZING = Dialect(lambda data: parse_chat_request(data, is_local=True), ChatReply)
COUNTING = Dialect(lambda data: parse_messages_request(data, is_counted_only=True),
                   MessagesReply)  # count_tokens: prepared as a Messages call, never answered


class LocalAnswerer:
    """The engine behind the server: queue, prompt checks, generation; the APIs' answers."""

    def __init__(self, backend: LocalBackend, *, max_queue: int = 16,
                 strict_model: bool = False) -> None:
        if max_queue < 0:
            raise UsageError(f"max_queue must be >= 0, not {max_queue}")
        # Each answer's output is owed, not stored before the reply (owing_output:
        # a forward less per answer; the next request that holds it computes it),
        # and `cached_tokens` counts only KV the cache held.
        # A backend that batches already (shared with other servers) is used as
        # it is; else this answerer starts an engine thread of its own, and stops it.
        self._owns_batcher = backend.batcher is None
        self._backend = backend.owing_output().batching()
        self.is_model_strict = strict_model
        self._capacity = max_queue + 1  # decoded together, or waiting for a place
        self._in_flight = 0
        self._num_cancelled = 0
        self._max_prompt_bytes = _max_prompt_bytes(backend.engine)
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="kvtrace-prepare")
        # One thread per request held, each waiting for its generation in the batcher.
        self._waiters = ThreadPoolExecutor(self._capacity, thread_name_prefix="kvtrace-wait")
        # A server lives for hours: the transient tensors' freed pages go back to the
        # kernel between its work, or they would keep the heap growing (kvtrace/engine/heap.py).
        batcher = self._backend.batcher
        if batcher is not None:
            batcher.keep_heap_trimmed()

    @property
    def model(self) -> str:
        return self._backend.model

    @property
    def required_model(self) -> str | None:
        return self.model if self.is_model_strict else None

    @property
    def dtype(self) -> str:
        """The engine's number format ("float32", "bfloat16")."""
        return str(self._backend.engine.dtype).removeprefix("torch.")

    @property
    def description(self) -> str:
        return f"local model {self.model}, {self.dtype}"

    @property
    def queue(self) -> dict[str, int]:
        batcher = self._backend.batcher
        running = min(self._in_flight, batcher.max_batch if batcher is not None else 1)
        return {"running": running, "waiting": self._in_flight - running,
                "capacity": self._capacity, "cancelled": self._num_cancelled}

    @property
    def batch(self) -> dict[str, float]:
        """How the requests were decoded: forwards run, rows they decoded, the most at once,
        seconds spent decoding (prefills and output inserts aside)."""
        batcher = self._backend.batcher
        if batcher is None:  # batching() always gives one
            return {}
        return {"max_batch": batcher.max_batch, "decode_steps": batcher.num_steps,
                "decoded_rows": batcher.num_step_rows, "max_rows": batcher.max_step_rows,
                "decode_s": round(batcher.decode_seconds, 3)}

    def take_cache_faults(self) -> DiskFaults | None:
        return self._backend.take_cache_faults()

    def health(self) -> dict[str, Any]:
        probes = self._backend.engine.probes  # measured at this start, or kept (memo.py)
        return {"mode": "local", "model": self.model, "dtype": self.dtype, "queue": self.queue,
                "batch": self.batch, "threads": self._backend.threads,
                "probes": {"measured": list(probes.measured),
                           "remembered": list(probes.remembered)}}

    async def close(self) -> None:
        self._preparer.shutdown(wait=True)
        self._waiters.shutdown(wait=True)
        if self._owns_batcher:
            self._backend.close()

    async def answer(self, request: Request, body: bytes, sink: Sink) -> Response:
        """An answer in the API of the path, or the model list; any other path is a 404."""
        route = (request.method, request.url.path)
        if route == ("GET", MODELS_PATH):
            return JSONResponse(model_list(self.model))
        loop = asyncio.get_running_loop()
        if route == ("POST", COUNT_TOKENS_PATH):  # the prompt's length: nothing generated
            _, prompt = await loop.run_in_executor(self._preparer, self.prepare, COUNTING, body)
            return JSONResponse({"input_tokens": len(prompt)})
        if route == ("POST", TOKENIZE_PATH):  # the prompt's ids, as vLLM's /tokenize gives them
            prompt = await loop.run_in_executor(self._preparer, self._tokenize, body)
            return JSONResponse({"count": len(prompt), "tokens": prompt,
                                 "max_model_len": self._backend.engine.max_context_tokens})
        if route == ("POST", DETOKENIZE_PATH):  # their text, as vLLM's /detokenize gives it
            ids = detokenize_request(body)
            text = await loop.run_in_executor(self._preparer, self._detokenize, ids)
            return JSONResponse({"prompt": text})
        dialect = DIALECTS.get(request.url.path) if request.method == "POST" else None
        if dialect is None:
            raise APIError(404, f"{request.method} {request.url.path} is not served in local "
                           f"mode (POST {CHAT_PATH}, POST {MESSAGES_PATH}, POST "
                           f"{RESPONSES_PATH}, GET {MODELS_PATH})", code="not_found")
        call, prompt = await loop.run_in_executor(self._preparer, self.prepare, dialect, body)
        generation = await self._queued(request, call, prompt)
        reply = dialect.reply(call, generation, model=self.model)
        url = str(request.url)
        if not call.is_stream:
            await sink.record(reply.step(url))
            return JSONResponse(reply.body)
        events = list(reply.events())
        await sink.check_open(is_answered=True)  # paused meanwhile: a 409, before any byte

        async def stream() -> AsyncIterator[bytes]:
            is_recorded = False
            try:
                for index, event in enumerate(events):
                    if index == len(events) - 1:  # the stream's end: recorded before it is sent
                        is_recorded = True  # before the wait: the write goes on if we are
                        try:  # cancelled meanwhile
                            await sink.record(reply.step(url))
                        except APIError as exc:  # paused since the check: refused, unrecorded
                            yield stream_error_event(request.url.path, exc)
                            return
                        except Exception as exc:  # the store failed: app.py's 500, as an event
                            yield stream_error_event(request.url.path, failed_answer(
                                request.method, request.url.path, exc))
                            return
                    yield event
            finally:
                if not is_recorded:  # the client left early: the answer, marked incomplete
                    sink.record_later(reply.step(url, is_complete=False))

        return ClosingStream(stream(), media_type="text/event-stream")

    def _tokenize(self, body: bytes) -> list[int]:
        """/tokenize: the prompt's ids, or with `add_generation_prompt: false` the
        conversation's as the template closes it (what replay reads an output's ids from)."""
        generation_prompt, data = tokenize_request(body, self.model)
        call = TOKENIZING.parse(data)
        # A prompt past the context is tokenised all the same, as vLLM's /tokenize does: a
        # replay counting with it stops there itself, saying so.
        prompt = self.check(call, limit_context=False)
        if generation_prompt:
            return prompt
        return self._backend.engine.chat_tokens(call.messages, tools=call.tools,
                                                add_generation_prompt=False)

    def _detokenize(self, ids: list[int]) -> str:
        vocab = self._backend.engine.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise APIError(400, f"tokens: every id must be in 0..{vocab - 1}", param="tokens",
                           code="invalid_value")
        return self._backend.engine.decode(ids, skip_special_tokens=False)

    def prepare(self, dialect: Dialect, body: bytes) -> tuple[LocalCall, list[int]]:
        """The checked request and its prompt's token ids (on the prepare thread)."""
        call = dialect.parse(body)
        return call, self.check(call)

    def check(self, request: LocalCall, *, limit_context: bool = True) -> list[int]:
        """The prompt's token ids, after the checks that do not need the engine's time
        (`limit_context=False`: a prompt past the model's context too)."""
        if self.is_model_strict and request.model != self.model:
            raise APIError(404, f"the model {request.model!r} does not exist here: this server "
                           f"serves {self.model!r} (GET /v1/models)", param="model",
                           code="model_not_found")
        check_text_only(request.messages)
        engine = self._backend.engine
        limit = engine.max_context_tokens
        text_bytes = _text_bytes(request.messages)
        if (limit_context and self._max_prompt_bytes is not None
                and text_bytes > self._max_prompt_bytes):
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                           f"messages hold {text_bytes:,} bytes of text, more than {limit} "
                           "tokens can hold: shorten them", param="messages",
                           code="context_length_exceeded")
        try:
            prompt = engine.chat_tokens(request.messages, tools=request.tools)
        except UsageError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
        if limit_context and limit is not None and len(prompt) >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                           f"messages take {len(prompt)}: shorten them", param="messages",
                           code="context_length_exceeded")
        return prompt

    async def _queued(self, client: Request, request: LocalCall,
                      prompt: list[int]) -> Generation:
        """Queue for the engine (429 when the queue is full), then generate; cancelled when
        the client leaves (the module docstring)."""
        if self._in_flight >= self._capacity:
            raise APIError(429, f"the server is busy: {self._capacity - 1} requests already "
                           "wait for the engine; retry later", kind="rate_limit_error",
                           code="rate_limit_exceeded")
        self._in_flight += 1
        cancelled = threading.Event()
        agent = agent_of(client)
        try:
            loop = asyncio.get_running_loop()
            job = loop.run_in_executor(self._waiters, self._generate, request, prompt,
                                       cancelled, agent.seed if agent is not None else None)
            return await unless_client_leaves(client, job, stop=cancelled.set)
        finally:
            self._in_flight -= 1
            if cancelled.is_set():
                self._num_cancelled += 1

    def _generate(self, request: LocalCall, prompt: list[int], cancelled: threading.Event,
                  agent_seed: int | None) -> Generation:
        if cancelled.is_set():  # its client left while it waited: the engine never starts it
            raise client_left()
        body = request.body
        limit = self._backend.engine.max_context_tokens
        max_new = request.max_tokens or DEFAULT_MAX_TOKENS
        if limit is not None:
            max_new = max(1, min(max_new, limit - len(prompt)))
        temperature = float(body.get("temperature") or 0.0)
        seed = body.get("seed")
        params = SamplingParams(
            temperature=temperature,
            top_p=float(body.get("top_p") or 1.0),
            seed=(agent_seed if seed is None else seed) if temperature > 0 else None,
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
        text, finish, stop_sequence = result.text, result.finish_reason, None
        found = [(text.index(stop), stop) for stop in request.stop if stop and stop in text]
        if found:  # cut at the earliest
            at, stop_sequence = min(found, key=lambda hit: hit[0])
            text, finish = text[:at], "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if request.parses_tool_calls:
            from kvtrace.rendering import id_seed, parse_assistant_text

            message = parse_assistant_text(text, id_seed=id_seed(request.messages))
        is_seed_chosen = temperature > 0 and body.get("seed") is None and result.seed is not None
        timings = {"total_s": round(time.perf_counter() - started, 6),
                   "prefill_s": round(result.prefill_s, 6), "decode_s": round(result.decode_s, 6)}
        return Generation(
            text=text, message=message, finish_reason=finish, stop_sequence=stop_sequence,
            prompt_tokens=result.prompt_tokens, reused_tokens=result.reused_tokens or 0,
            output_ids=list(result.output_ids or []),
            chosen_seed=result.seed if is_seed_chosen else None, timings=timings)


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
