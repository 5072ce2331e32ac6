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
  kvtrace's prompt (a peer with its own template once computed 134,875
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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvtrace.rendering import chat_messages
from kvtrace.replay.backend import CallRequest, SamplingParams
from kvtrace.replay.recording import step_messages, step_tools
from kvtrace.store import ModelCall, Step

UNRELATED = [{"role": "user", "content": "Unrelated: say one word."}]
UNRELATED_PROMPT = "one unrelated prompt"  # how `make_cold` says it made a peer cold that way
# Endpoints that empty a server's prefix cache, tried in order: vLLM's (dev mode), SGLang's.
_RESETS = ("/reset_prefix_cache", "/flush_cache")


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


def server_root(url: str) -> str:
    """A server's root from its API base URL (…/v1 off): where /tokenize and resets live."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def peer_messages(step: Step, *, native_tools: bool) -> tuple[list[dict[str, Any]],
                                                             list[dict[str, Any]] | None]:
    """(messages, tools) of a recorded call as kvtrace's template sees them (module docstring).

    A null content goes as "" (llama.cpp's server refuses an assistant message whose
    content is null, a tool call's; kvtrace's templates render both alike).
    """
    messages, tools = step_messages(step), step_tools(step)
    if not native_tools:
        messages, tools = chat_messages(messages, tools, native=False)
    return [m | {"content": ""} if m.get("content") is None else m for m in messages], tools


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
        body: dict[str, Any] = {"messages": request.messages, "add_generation_prompt": True}
        if model is not None or request.model is not None:
            body["model"] = model or request.model
        if request.tools:
            body["tools"] = request.tools
        try:
            response = client.post(f"{root}/tokenize", json=body)
        except httpx.HTTPError as exc:
            return TokenCheck(0, f"{root}/tokenize: {exc}")
        if response.status_code >= 400 or "tokens" not in _json(response):
            return TokenCheck(0, f"{root}/tokenize answered HTTP {response.status_code}, "
                                 "without token ids for chat messages")
        theirs = [int(t) for t in _json(response)["tokens"]]
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
    for path in _RESETS:
        try:
            if client.post(f"{root}{path}").status_code < 400:
                return path.lstrip("/")
        except httpx.HTTPError:
            continue
    body = {"model": model or "default", "messages": UNRELATED, "max_tokens": 1,
            "temperature": 0.0}
    client.post(f"{base_url.rstrip('/')}/chat/completions", json=body).raise_for_status()
    return UNRELATED_PROMPT


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
