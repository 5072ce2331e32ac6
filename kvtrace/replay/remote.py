"""Replay through any OpenAI-compatible server (vLLM, SGLang, kvtrace serve).

The server keeps its own prefix cache; what it reused is read from
`usage.prompt_tokens_details.cached_tokens`. A server that does not report it
gets None (printed "unknown"), never a guess. Rebuild cannot feed an output
without generating over this API, so it sends each recorded prompt with
`max_tokens=1`: the server caches the prompt, and the recorded output, which
the next prompt contains, is cached when that prompt is sent. Timing covers
the whole request (the API does not separate prefill from decode), so it is
reported as `prefill_s`.

A request that failed in a way that can go away by itself (the server
unreachable or overloaded: connect errors, 429, 5xx) is sent again with
backoff, honouring `Retry-After` (retry.py; `retry=NO_RETRY` turns it off).
What was retried travels back in `CallResult.retries`, so the report shows it.
One backend may be used from many threads at once (`is_concurrent`): httpx's
client is thread-safe and keeps a pool of connections.

Every httpx error becomes a BackendError (`raise ... from exc`) whose message
names the URL, the attempts made and what to check.

What the engine says of itself beyond chat completions (engines.py) is asked
once, at first need: its own token ids for the oracle (preferred over
`tokenizer`, which is the fallback), the block size its cache reuses whole,
and its cache counters, each request sent again under the same retry policy. What it
could not say becomes a note of the report.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import httpx

from kvtrace.errors import BackendError, UsageError
from kvtrace.rendering import assistant_text
from kvtrace.replay.backend import Backend, CallRequest, CallResult, Tokenizer
from kvtrace.replay.engines import (
    EngineFacts,
    engine_block_size,
    probe_tokenizer,
    read_counters,
    reset_cache,
    server_root,
)
from kvtrace.replay.retry import Attempts, RetryPolicy, tally
from kvtrace.store.usage import Usage


class RemoteBackend:
    """An OpenAI-compatible chat-completions endpoint at `base_url` (e.g. http://host:8000/v1).

    `model` is the name sent with each request; without one, each call sends
    the model its recording names. `retry` says how failed requests are sent
    again (module docstring). `tokenizer` counts the oracle where the engine
    gives no token ids of its own (`engine_tokens=False`: never asked);
    `block_size` is the engine's cache block size where it does not say.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        tokenizer: Tokenizer | None = None,
        timeout_s: float = 600.0,
        retry: RetryPolicy | None = None,
        engine_tokens: bool = True,
        block_size: int | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise UsageError(f"backend URL {base_url!r} must start with http:// or https://")
        self._base_url = base_url.rstrip("/")
        self._model = model
        self._tokenizer = tokenizer
        self._retry = retry or RetryPolicy()
        if block_size is not None and block_size < 1:
            raise UsageError(f"the engine's block size must be at least 1, not {block_size}",
                             param="block_size")
        self._engine_tokens = engine_tokens
        self._block_size = block_size
        self._facts: EngineFacts | None = None
        self._engine_tokenizer: Tokenizer | None = None
        self._learning = threading.Lock()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No pool limit: the caller bounds the requests in flight (replay_runs' concurrency),
        # and a connection kept per thread saves a reconnect per request.
        self._client = httpx.Client(base_url=self._base_url, headers=headers, timeout=timeout_s,
                                    limits=httpx.Limits(max_connections=None,
                                                        max_keepalive_connections=None))

    @property
    def name(self) -> str:
        return self._base_url

    @property
    def model(self) -> str:
        return self._model or "as recorded"

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The engine's own where it gives token ids, else the one given (or None)."""
        self.engine_facts  # noqa: B018 (asks the engine once)
        return self._engine_tokenizer or self._tokenizer

    @property
    def engine_facts(self) -> EngineFacts:
        """What the engine said of its tokens and block size (asked once, at first need)."""
        with self._learning:
            if self._facts is None:
                self._facts = self._learn()
            return self._facts

    def engine_counters(self) -> dict[str, int] | None:
        """The engine's prefix-cache counters now (engines.read_counters; None: it has none)."""
        return read_counters(self._client, server_root(self._base_url), retry=self._retry)

    def reset_cache(self) -> str:
        """Empty the engine's prefix cache, so a replay starts cold; the endpoint that did.
        BackendError, saying what the engine answered, where it has no reset."""
        return reset_cache(self._client, server_root(self._base_url), retry=self._retry)

    @property
    def is_concurrent(self) -> bool:
        """True: calls may come from many threads (one pooled, thread-safe httpx client)."""
        return True

    @property
    def retry(self) -> RetryPolicy:
        return self._retry

    def close(self) -> None:
        """Close the HTTP connections (the backend is then unusable)."""
        self._client.close()

    def __enter__(self) -> RemoteBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, request: CallRequest) -> CallResult:
        params = request.params
        body: dict[str, Any] = {
            "messages": request.messages,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        return self._complete(request, body)

    def rebuild(self, request: CallRequest) -> CallResult:
        body = {"messages": request.messages, "max_tokens": 1, "temperature": 0.0}
        return replace(self._complete(request, body), is_output_fed=False)

    def settle(self) -> None:
        """Nothing to do: the server keeps its own cache."""

    @property
    def resume_every(self) -> int:
        """The engine's block size: its cache reuses whole blocks (1 where it is unknown)."""
        return self.engine_facts.block_size

    def take_cache_faults(self) -> None:
        """None: the server's cache is its own business (and its own log's)."""

    def without_cache(self) -> Backend:
        raise UsageError(
            "a remote server's prefix cache cannot be switched off from here: "
            "compare_uncached=True works with the local backend only", param="compare_uncached"
        )

    def _complete(self, request: CallRequest, body: dict[str, Any]) -> CallResult:
        model = self._model or request.model or "default"
        body = {"model": model, "stream": False, **body}
        if request.tools:
            body["tools"] = request.tools
        attempts = Attempts(self._retry)
        url = f"{self._base_url}/chat/completions"
        try:
            response = attempts.send(lambda: self._client.post("/chat/completions", json=body))
        except httpx.HTTPError as exc:
            raise BackendError(
                f"cannot reach {url} ({exc}{_tried(attempts)}): is the server "
                "running, and does the URL end with its API prefix (often /v1)?"
            ) from exc
        if response.status_code >= 400:
            waited = ("" if attempts.refused_wait_s is None else
                      f"; it asked to retry after {attempts.refused_wait_s:g} s, longer than "
                      f"the retry policy's max_delay_s={self._retry.max_delay_s:g}")
            raise BackendError(
                f"{self._base_url} answered HTTP {response.status_code}{_tried(attempts)}"
                f"{waited}: {' '.join(response.text[:300].split())}"
            )
        try:
            data = response.json()
            choice = data["choices"][0]
            # Tool calls as kvtrace renders them (rendering.py), so that
            # verify and continue read them back like a local generation.
            text = assistant_text(choice["message"])
            finish = str(choice.get("finish_reason") or "unknown")
            usage = Usage.parse(data.get("usage"))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise BackendError(
                f"{self._base_url} answered something that is not an OpenAI chat completion "
                f"({type(exc).__name__}: {exc}): {response.text[:200]}"
            ) from exc
        # An answer without usage is still an answer: its prompt is counted as the tokenizer
        # counts it (0 without one), its reuse is unknown, and the report says so.
        counted = usage.prompt_tokens
        prompt_tokens = counted if counted is not None else len(request.prompt_ids or [])
        return CallResult(
            prompt_tokens=prompt_tokens,
            is_usage_missing=counted is None,
            reused_tokens=None if counted is None else _reused(usage.cached_tokens,
                                                                prompt_tokens),
            memory_tokens=None,
            disk_tokens=None,
            text=text,
            output_ids=None,
            finish_reason=finish,
            prefill_s=attempts.last_attempt_s,  # waits between attempts excluded
            decode_s=0.0,
            retries=tuple(attempts.retried),
        )

    def _learn(self) -> EngineFacts:
        root = server_root(self._base_url)
        notes = []
        engine_tokenizer, why = (probe_tokenizer(self._client, root, self._model,
                                                 retry=self._retry)
                                 if self._engine_tokens else (None, None))
        fallback = getattr(self._tokenizer, "name", "the tokenizer given")
        if engine_tokenizer is not None:
            self._engine_tokenizer = engine_tokenizer
            tokens: str | None = engine_tokenizer.name
        elif self._tokenizer is not None:
            tokens = f"{fallback} (--tokenizer)"
            if why is not None:
                notes.append(f"{why}: the oracle is counted with {tokens}, whose template may "
                             "differ from the engine's")
        else:
            tokens = None
            if why is not None:
                notes.append(f"{why}: no oracle bound (pass --tokenizer, the engine's model "
                             "folder)")
        named = (engine_block_size(self._client, root, retry=self._retry)
                 if self._block_size is None else None)
        size, source = ((self._block_size, "--engine-block-size") if self._block_size else
                        named or (1, "unknown: counted token by token"))
        return EngineFacts(tokens, size, source, tuple(notes))


def _reused(cached: int | None, prompt_tokens: int) -> int | None:
    """The cached tokens the server reported (None: not reported, unknown).

    Some servers count a fully cached prompt; the last token is still computed.
    """
    return None if cached is None else max(0, min(cached, prompt_tokens - 1))


def _tried(attempts: Attempts) -> str:
    """", after 5 attempts (HTTP 503 x4)" when the request was sent more than once."""
    if not attempts.retried:
        return ""
    return f", after {attempts.num_attempts} attempts ({tally(attempts.retried)})"

