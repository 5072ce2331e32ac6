"""A peer server as the benchmarks see it: cold on purpose, fed kvtrace's own tokens.

A comparison with another engine means something only when both sides
compute the same tokens from the same start, so a peer trial begins with
three things:

- **What the peer is sent** (`peer_messages`): the conversation as kvtrace's
  chat template sees it. Where the template renders tools itself (native),
  that is the recorded messages and tools, unchanged; where it does not (the
  default SmolLM2 template drops tools and tool calls), it is rendering.py's
  fallback turns, plain role and content, with the tool listing in the
  system turn. The peer's template, the model's own, then renders exactly
  kvtrace's prompt (a peer with its own template computes 134,875
  tokens of a workload that is 154,301 for kvtrace: not the same work).
- **A check of that** (`check_tokens`): each request is sent to the peer's
  `/tokenize` (vLLM's and SGLang's take chat messages), and its ids must be
  kvtrace's, request by request; `TokenMismatchError` otherwise, and the
  benchmark refuses to compare. A peer without such an endpoint (llama.cpp's
  Python server) is reported unchecked, with the reason.
- **A cold cache** (`make_cold`): vLLM's `POST /reset_prefix_cache` (its
  server runs with `VLLM_SERVER_DEV_MODE=1`), SGLang's `POST /flush_cache`,
  else one unrelated prompt, which empties a single-slot cache (llama.cpp's)
  and nothing more. Whether a trial did start cold is read off its first
  request: a cold peer reports no cached tokens for it (`cold_start`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvtrace.bench.servers import vllm_server
from kvtrace.engine.sampling import SamplingParams
from kvtrace.errors import EngineRefusedError
from kvtrace.paths import default_cache_dir
from kvtrace.rendering import template_messages
from kvtrace.replay.backend import CallRequest
from kvtrace.replay.engines import ServerTokenizer, json_object, reset_cache, server_root
from kvtrace.replay.oracle import common_prefix_length
from kvtrace.replay.recording import prompt_ids, step_messages, step_tools
from kvtrace.replay.remote import RemoteBackend
from kvtrace.store import ModelCall, Step

UNRELATED = [{"role": "user", "content": "Unrelated: say one word."}]
UNRELATED_PROMPT = "one unrelated prompt"  # how `make_cold` says it made a peer cold that way


@dataclass(frozen=True, slots=True)
class Trial:
    """One side's timed replay of a schedule: seconds, prompt tokens counted, the tokens the
    server says it computed and reused of its first prompt (None: it reports no cached
    tokens), how it was made cold, and the requests sent more than once (retry.py)."""

    seconds: float
    prompt_tokens: int
    computed: int | None
    cold_by: str
    first_reused: int | None
    retried: int = 0

    def is_figure(self, shared: int) -> bool:
        """Whether the trial counts: it started cold (its first request reused at most the
        `shared` tokens a cold cache may hold) and no request was sent twice."""
        return self.retried == 0 and (self.first_reused is None
                                      or self.first_reused <= shared)

    def cold_start(self, shared: int) -> str:
        """How it was made cold, or what says it is no figure (`is_figure`)."""
        if self.retried:
            return f"NO FIGURE: {self.retried} requests retried ({self.cold_by})"
        if self.first_reused is None:
            return f"{self.cold_by} (unverified: no cached tokens reported)"
        if self.first_reused <= shared:
            return self.cold_by
        return f"NOT COLD: {self.first_reused} tokens of its first prompt reused ({self.cold_by})"


def timed_replay(client: RemoteBackend, requests: list[CallRequest], *, cold_by: str) -> Trial:
    """Send every request through `client`, one after another, timing the whole."""
    started = time.perf_counter()
    results = [client.rebuild(request) for request in requests]
    seconds = time.perf_counter() - started
    computed = [r.computed_tokens for r in results]
    reported = None if None in computed else sum(c for c in computed if c is not None)
    return Trial(seconds, sum(r.prompt_tokens for r in results), reported, cold_by,
                 results[0].reused_tokens, sum(1 for r in results if r.retries))


class PeerSide:
    """The peer of a benchmark over `schedule` (recorded model calls, in the order sent):
    `peer` is its base URL, or "vllm" to start vLLM's CPU build in `folder` for as long as
    `stack` lasts. `check` compares its tokens with kvtrace's (`engine`'s), `trial` makes it
    cold and times the schedule through it."""

    def __init__(self, stack: ExitStack, peer: str, *, engine: Any, schedule: list[Step],
                 folder: Path, model: str | None, peer_model: str | None, dtype: str,
                 block_size: int | None) -> None:
        self._started = peer == "vllm"
        if self._started:
            peer_model = peer_model or "smollm2"
            peer = stack.enter_context(vllm_server(
                folder / "vllm", model=model, cache_dir=default_cache_dir(), alias=peer_model,
                dtype=dtype, block_size=block_size))
        self.url, self.model = peer, peer_model
        self._root = server_root(peer)
        self._http = stack.enter_context(httpx.Client(timeout=600.0))
        # A peer that is kvtrace serve renders the conversation itself, as kvtrace does (and
        # refuses a tool turn that answers no call, as the providers' APIs do): it is sent
        # the recorded messages; any other is sent them as kvtrace's template sees them.
        native = engine.supports_tools or is_kvtrace_serve(self._http, self._root)
        self._requests = [peer_request(step, native_tools=native) for step in schedule]
        self.expected = [prompt_ids(engine, step) for step in schedule]
        # What an unrelated prompt shares with the first (the template's first tokens): what
        # a cache made cold by it may still reuse.
        self._shared = common_prefix_length(engine.chat_tokens(UNRELATED), self.expected[0])
        self.trials: list[Trial] = []

    def check(self) -> TokenCheck:
        """`check_tokens` over the whole schedule (raises TokenMismatchError, and where the
        peer is the vLLM started here, which has /tokenize, when it could not check)."""
        checked = check_tokens(self._http, self._root, self.model, self._requests,
                               self.expected)
        if self._started and checked.unchecked_reason is not None:
            raise TokenMismatchError(f"vLLM could not tokenize the requests: "
                                     f"{checked.unchecked_reason}")
        return checked

    def trial(self) -> Trial:
        """Make the peer cold, then time the schedule through it (kept in `trials`)."""
        with RemoteBackend(self.url, model=self.model) as client:
            cold_by = make_cold(self._http, self._root, self.url, self.model)
            self.trials.append(timed_replay(client, self._requests, cold_by=cold_by))
        return self.trials[-1]

    def cold_starts(self) -> list[str]:
        """Each trial's `Trial.cold_start`."""
        return [t.cold_start(self._shared_by(t)) for t in self.trials]

    def fastest_cold_s(self) -> float | None:
        """The fastest trial that is a figure (`Trial.is_figure`; None: none is)."""
        cold = [t.seconds for t in self.trials if t.is_figure(self._shared_by(t))]
        return min(cold) if cold else None

    def _shared_by(self, trial: Trial) -> int:
        return self._shared if trial.cold_by == UNRELATED_PROMPT else 0


def is_kvtrace_serve(client: httpx.Client, root: str) -> bool:
    """Whether the server at `root` is `kvtrace serve` (its /health names its run and queue)."""
    try:
        health = json_object(client.get(f"{root}/health"))
    except httpx.HTTPError:
        return False
    return health.get("status") == "ok" and "run" in health and "queue" in health


class TokenMismatchError(RuntimeError):
    """The peer would compute other tokens than kvtrace for a request: no fair comparison."""


@dataclass(frozen=True, slots=True)
class TokenCheck:
    """What `check_tokens` found: requests checked (0 when the peer cannot say), and why not."""

    checked: int
    unchecked_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.unchecked_reason is not None:
            return {"checked": 0, "unchecked": self.unchecked_reason}
        return {"checked": self.checked, "agree": True}


def peer_messages(step: Step, *, native_tools: bool) -> tuple[list[dict[str, Any]],
                                                             list[dict[str, Any]] | None]:
    """(messages, tools) of a recorded call as kvtrace's template sees them (module docstring),
    a null content as "" (`without_null_content`)."""
    messages, tools = step_messages(step), step_tools(step)
    if not native_tools:
        # Plain turns, but a tool turn keeps the id of the call it answers: servers check it
        # (llama.cpp's refuses a tool message without one); templates that read role and
        # content never render it.
        ids = iter([m.get("tool_call_id") for m in messages if m.get("role") == "tool"])
        rendered, tools = template_messages(messages, tools, native=False)
        messages = [m | {"tool_call_id": next(ids, None) or "call"} if m["role"] == "tool"
                    else m for m in rendered]
    return without_null_content(messages), tools


def without_null_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with a null content as "" (llama.cpp's server refuses an assistant message
    whose content is null, a tool call's; kvtrace's templates render both alike)."""
    return [m | {"content": ""} if m.get("content") is None else m for m in messages]


def peer_request(step: Step, *, native_tools: bool) -> CallRequest:
    """A rebuild request (`max_tokens=1`) for a recorded call, as the peer is sent it."""
    messages, tools = peer_messages(step, native_tools=native_tools)
    return CallRequest(messages, None, SamplingParams(max_new_tokens=1),
                       model=ModelCall(step).model, tools=tools)


def check_tokens(client: httpx.Client, root: str, model: str | None,
                 requests: Sequence[CallRequest], expected: Sequence[Sequence[int]]
                 ) -> TokenCheck:
    """Ask the peer's `/tokenize` for each request's ids and compare them with `expected`
    (kvtrace's); raises TokenMismatchError at the first that differs."""
    for index, (request, ids) in enumerate(zip(requests, expected, strict=True)):
        tokenizer = ServerTokenizer(client, root, model or request.model)
        try:
            theirs = tokenizer.chat_tokens(request.messages, tools=request.tools)
        except EngineRefusedError as exc:
            return TokenCheck(0, f"{exc} (without token ids for chat messages)")
        if theirs != list(ids):
            at = next((i for i, (a, b) in enumerate(zip(theirs, ids, strict=False))
                       if a != b),
                      min(len(theirs), len(ids)))
            raise TokenMismatchError(
                f"the peer renders request {index + 1} as {len(theirs)} tokens, kvtrace as "
                f"{len(ids)}; they part at token {at}: give the peer the model's own chat "
                "template (the two would compute different prompts, so they are not compared)")
    return TokenCheck(len(requests))


def make_cold(client: httpx.Client, root: str, base_url: str, model: str | None) -> str:
    """Empty the peer's prefix cache; says how (module docstring)."""
    try:
        return reset_cache(client, root).lstrip("/")
    except EngineRefusedError:
        pass
    body = {"model": model or "default", "messages": UNRELATED, "max_tokens": 1,
            "temperature": 0.0}
    client.post(f"{base_url.rstrip('/')}/chat/completions", json=body).raise_for_status()
    return UNRELATED_PROMPT
