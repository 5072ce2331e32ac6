"""What kvtrace asks a serving engine besides chat completions: its own tokens, its cache's
block size, an empty cache, and its cache counters.

A replay through a remote engine measures that engine's cache, so its oracle bound must be
counted in the token ids the engine saw, rendered by the engine's own chat template: a
local tokenizer whose template differs counts other tokens, and a bound over 100 % follows.
Each question has an endpoint on some engines and none on others; a missing one is said
once, in a line the report carries, and the replay goes on with what it can measure.

- **Tokens** (`ServerTokenizer`): `POST /tokenize` with chat messages, as vLLM and kvtrace
  serve take it (`{"model", "messages", "tools", "add_generation_prompt"}` → `{"tokens"}`),
  and `POST /detokenize` (`{"tokens"}` → `{"prompt"}`); llama.cpp's server renders with
  `POST /apply-template` and then tokenizes the text (`{"content"}`). SGLang's `/tokenize`
  takes text only, so it, and any engine without these, falls back to `--tokenizer`.
- **Block size** (`engine_block_size`): a prefix cache of whole blocks reuses a prompt up to
  a block boundary only, so the token-exact bound is out of its reach by design. vLLM names
  its block size in `/metrics` (`vllm:cache_config_info{block_size=...}`), SGLang its page
  size in `/get_server_info`; otherwise the user says (`--engine-block-size`).
- **An empty cache** (`reset_cache`): vLLM's `POST /reset_prefix_cache` (its server in dev
  mode, `VLLM_SERVER_DEV_MODE=1`), SGLang's `POST /flush_cache`, llama.cpp's `POST
  /slots/{id}?action=erase` for each slot it lists.
- **Counters** (`read_counters`): vLLM's prefix-cache queries and hits, and those of an
  external KV tier such as LMCache (`vllm:external_prefix_cache_*`), summed over the
  engine's processes; a replay reports what they grew by.

An engine's endpoints live at its root (the base URL less `/v1`). Every request here has a
timeout of its own (60 s), shorter than a chat call's, and is sent again under the caller's
retry policy (retry.py; a remote backend passes its own, so `--retries 0` asks once): an
engine still loading answers 503 for a while, and a replay must not count in other tokens
for it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvtrace.errors import EngineRefusedError
from kvtrace.replay.retry import Attempts, RetryPolicy

_PROBE = [{"role": "user", "content": "hi"}]
_RESETS = ("/reset_prefix_cache", "/flush_cache")  # vLLM's (dev mode), SGLang's
_TIMEOUT_S = 60.0  # per request: an endpoint that hangs must not hold a replay for long
# The policy where a caller names none (peer benchmarks, `analyze --backend`).
ENGINE_RETRY = RetryPolicy(max_attempts=3, base_delay_s=0.25, max_delay_s=5.0)
# Renderings kept (least recently used dropped): a replay asks for each call's a few times
# in a row, and many runs at once interleave theirs.
_MEMO_SIZE = 1024
# Prometheus text: `name{labels} value`, the labels optional.
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+"
                     r"(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
COUNTERS = {  # what read_counters reports, by the vLLM metric it sums
    "vllm:prefix_cache_queries": "queried_tokens",
    "vllm:prefix_cache_hits": "hit_tokens",
    "vllm:external_prefix_cache_queries": "external_queried_tokens",
    "vllm:external_prefix_cache_hits": "external_hit_tokens",
}


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What a remote backend learned of its engine, for the report: where its token ids come
    from, its block size and where that was read, and what it could not learn (lines)."""

    tokens: str | None  # "the engine's own (...)", "--tokenizer X", or None: no token ids
    block_size: int
    block_size_from: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "block_size": self.block_size,
                "block_size_from": self.block_size_from}


def server_root(url: str) -> str:
    """An engine's root from its API base URL (…/v1 off): where these endpoints live."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class ServerTokenizer:
    """The engine's own tokenizer, behind its HTTP endpoints (module docstring), as replay's
    `Tokenizer`: the oracle and token positions are then in the ids the engine saw.

    The stop token is not served over HTTP; it is learned from two renderings of a short
    answered turn that differ only in the answer: the tokens both end with are how the
    template closes an assistant turn, and the first of them is where a generation stops
    (SmolLM2's `<|im_end|>` before its newline; Llama 3's `<|eot_id|>`). Answers are kept:
    a replay asks for each prompt more than once. Thread-safe (httpx's client is; the memo
    has a lock).
    """

    def __init__(self, client: httpx.Client, root: str, model: str | None, *,
                 llama_cpp: bool = False, retry: RetryPolicy = ENGINE_RETRY) -> None:
        self._client = client
        self._retry = retry
        self._root = root
        self._model = model
        self._llama_cpp = llama_cpp
        self._memo: OrderedDict[bytes, list[int]] = OrderedDict()  # by the body's digest
        self._lock = threading.Lock()
        self._stops: tuple[int, ...] | None = None
        self.max_context_tokens: int | None = None

    is_thread_safe = True  # replay_runs' threads may call it at once, without a lock

    @property
    def name(self) -> str:
        how = "/apply-template and /tokenize" if self._llama_cpp else "/tokenize"
        return f"the engine's own tokens ({how} at {self._root})"

    @property
    def eos_token_ids(self) -> Sequence[int]:
        """The token that closes an assistant turn (class docstring); () if none is seen."""
        if self._stops is None:
            self._stops = self._closing_token()
        return self._stops

    def _closing_token(self) -> tuple[int, ...]:
        asked = [{"role": "user", "content": "Hi"}]
        try:
            start = self.chat_tokens(asked)
            tails = [self.chat_tokens([*asked, {"role": "assistant", "content": answer}],
                                      add_generation_prompt=False) for answer in ("a", "b")]
        except EngineRefusedError:
            return ()
        if any(tail[: len(start)] != start for tail in tails):
            return ()
        a, b = (tail[len(start):] for tail in tails)
        shared = 0
        while shared < min(len(a), len(b)) and a[-1 - shared] == b[-1 - shared]:
            shared += 1
        return (a[-shared],) if 0 < shared < len(a) else ()

    def chat_tokens(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The ids the engine renders `messages` (and `tools`) to (EngineRefusedError: none)."""
        body: dict[str, Any] = {"messages": list(messages),
                                "add_generation_prompt": add_generation_prompt}
        if tools:
            body["tools"] = list(tools)
        if self._model is not None:
            body["model"] = self._model
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
        with self._lock:
            known = self._memo.get(key)
            if known is not None:
                self._memo.move_to_end(key)
                return list(known)
        ids = self._llama_cpp_tokens(body) if self._llama_cpp else self._tokens(body)
        with self._lock:
            self._memo[key] = ids
            if len(self._memo) > _MEMO_SIZE:
                self._memo.popitem(last=False)
        return list(ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`, as the engine decodes them ("" where it cannot say)."""
        path = "/detokenize"
        try:
            data = _post(self._client, self._retry, f"{self._root}{path}", {"tokens": list(ids)}
                         | ({"model": self._model} if self._model else {}))
        except EngineRefusedError:
            return ""
        text = data.get("prompt", data.get("content", data.get("text")))
        return text if isinstance(text, str) else ""

    def _tokens(self, body: dict[str, Any]) -> list[int]:
        data = _post(self._client, self._retry, f"{self._root}/tokenize", body)
        if isinstance(data.get("max_model_len"), int):
            self.max_context_tokens = data["max_model_len"]
        return _ids(data, "tokens", f"{self._root}/tokenize")

    def _llama_cpp_tokens(self, body: dict[str, Any]) -> list[int]:
        """llama.cpp's /apply-template always adds the generation prompt: an output's tokens
        then end with the next turn's opening, which the next prompt shares up to its role,
        so the oracle's shared prefixes come out the same."""
        rendered = _post(self._client, self._retry, f"{self._root}/apply-template",
                         {"messages": body["messages"]} | (
                             {"tools": body["tools"]} if "tools" in body else {}))
        prompt = rendered.get("prompt")
        if not isinstance(prompt, str):
            raise EngineRefusedError(f"{self._root}/apply-template answered without a prompt")
        data = _post(self._client, self._retry, f"{self._root}/tokenize",
                     {"content": prompt, "add_special": True, "parse_special": True})
        return _ids(data, "tokens", f"{self._root}/tokenize")


def probe_tokenizer(client: httpx.Client, root: str, model: str | None, *,
                    retry: RetryPolicy = ENGINE_RETRY
                    ) -> tuple[ServerTokenizer | None, str | None]:
    """The engine's tokenizer for chat messages, or None and why not (one line).

    Tried in turn: `/tokenize` with messages (vLLM, kvtrace serve), then llama.cpp's
    `/apply-template`. An engine that answers with ids for one but not the other is taken
    at the one that worked.
    """
    reasons = []
    for llama_cpp in (False, True):
        tokenizer = ServerTokenizer(client, root, model, llama_cpp=llama_cpp, retry=retry)
        try:
            if tokenizer.chat_tokens(_PROBE):
                return tokenizer, None
            reasons.append("it gave no ids for a one-message chat")
        except EngineRefusedError as exc:
            reasons.append(str(exc))
    return None, f"the engine gives no token ids for chat messages ({reasons[0]})"


def engine_tokenizer(client: httpx.Client, base_url: str) -> ServerTokenizer:
    """The tokenizer of the engine at `base_url` (`probe_tokenizer`), or EngineRefusedError
    saying why it has none."""
    tokenizer, why = probe_tokenizer(client, server_root(base_url), None)
    if tokenizer is None:
        raise EngineRefusedError(f"{why}: count with --model, the engine's model folder")
    return tokenizer


def engine_block_size(client: httpx.Client, root: str, *, retry: RetryPolicy = ENGINE_RETRY
                      ) -> tuple[int, str] | None:
    """The engine's KV block size (its prefix cache reuses whole blocks) and where it was
    read: vLLM's /metrics, SGLang's /get_server_info; None when the engine does not say."""
    try:
        response = _ask(client, retry, "GET", f"{root}/metrics")
        if response.status_code == 200:
            for name, labels, _ in _samples(response.text):
                if name == "vllm:cache_config_info" and labels.get("block_size", "").isdigit():
                    return int(labels["block_size"]), "its /metrics"
    except httpx.HTTPError:
        pass
    try:
        response = _ask(client, retry, "GET", f"{root}/get_server_info")
        page = json_object(response).get("page_size") if response.status_code == 200 else None
        if isinstance(page, int) and page > 0:
            return page, "its /get_server_info"
    except httpx.HTTPError:
        pass
    return None


def reset_cache(client: httpx.Client, root: str, *, retry: RetryPolicy = ENGINE_RETRY) -> str:
    """Empty the engine's prefix cache; the endpoint that did it. EngineRefusedError when none did,
    naming what each answered (vLLM's needs its server in dev mode)."""
    answers = []
    for path in _RESETS:
        try:
            response = _ask(client, retry, "POST", f"{root}{path}")
        except httpx.HTTPError as exc:
            answers.append(f"{path}: {type(exc).__name__}")
            continue
        if response.status_code < 400:
            return path
        answers.append(f"{path}: HTTP {response.status_code}")
    try:
        return _erase_slots(client, root, retry)
    except EngineRefusedError as exc:
        answers.append(str(exc))
    raise EngineRefusedError(f"the engine's cache could not be emptied ({', '.join(answers)}); "
                        "vLLM resets only with VLLM_SERVER_DEV_MODE=1 set on its server")


def read_counters(client: httpx.Client, root: str, *, retry: RetryPolicy = ENGINE_RETRY
                  ) -> dict[str, int] | None:
    """vLLM's prefix-cache counters (`COUNTERS`), each summed over its labels; None when the
    engine has no such metrics."""
    try:
        response = _ask(client, retry, "GET", f"{root}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    totals: dict[str, float] = {}
    for name, _, value in _samples(response.text):
        key = COUNTERS.get(name.removesuffix("_total"))
        if key is not None and math.isfinite(value):
            totals[key] = totals.get(key, 0.0) + value
    return {key: int(value) for key, value in totals.items()} or None


def counters_grown(before: Mapping[str, int] | None, after: Mapping[str, int] | None
                   ) -> dict[str, int] | None:
    """What each counter grew by between two `read_counters`; None when either is unknown."""
    if before is None or after is None:
        return None
    return {key: after[key] - before.get(key, 0) for key in after}


def _erase_slots(client: httpx.Client, root: str, retry: RetryPolicy) -> str:
    """llama.cpp's server: erase every slot it lists; the endpoint, or EngineRefusedError
    with what it answered (it erases only when started with `--slot-save-path`)."""
    try:
        response = _ask(client, retry, "GET", f"{root}/slots")
        slots = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        slots = None
    if not isinstance(slots, list) or not slots:
        raise EngineRefusedError("/slots: none listed")
    for slot in slots:
        slot_id = slot.get("id") if isinstance(slot, dict) else None
        if not isinstance(slot_id, int):
            raise EngineRefusedError("/slots: a slot without an id")
        try:
            answer = _ask(client, retry, "POST", f"{root}/slots/{slot_id}",
                          params={"action": "erase"})
        except httpx.HTTPError as exc:
            raise EngineRefusedError(f"/slots/{slot_id}?action=erase: {exc}") from exc
        if answer.status_code >= 400:
            raise EngineRefusedError(
                f"/slots/{slot_id}?action=erase: HTTP {answer.status_code} (llama-server "
                "erases slots only when started with --slot-save-path)")
    return "/slots/{id}?action=erase"


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample line of a Prometheus text page."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        samples.append((match["name"], dict(_LABEL.findall(match["labels"] or "")), value))
    return samples


def _ask(client: httpx.Client, retry: RetryPolicy, method: str, url: str,
         **options: Any) -> httpx.Response:
    """One request to the engine, sent again while it fails in a way that may pass (by
    retry.py's rules); the last answer, or the last transport error."""
    return Attempts(retry).send(
        lambda: client.request(method, url, timeout=_TIMEOUT_S, **options))


def _post(client: httpx.Client, retry: RetryPolicy, url: str, body: dict[str, Any]
          ) -> dict[str, Any]:
    try:
        response = _ask(client, retry, "POST", url, json=body)
    except httpx.HTTPError as exc:
        raise EngineRefusedError(f"{url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code >= 400:
        detail = _error_message(response)
        raise EngineRefusedError(f"{url} answered HTTP {response.status_code}"
                                 + (f": {detail}" if detail else ""))
    return json_object(response)


def _error_message(response: httpx.Response) -> str | None:
    """The message of a JSON error body (OpenAI's `error.message`, FastAPI's `detail`), at
    most a line; None for any other body (an HTML page says nothing worth a report line)."""
    data = json_object(response)
    error = data.get("error")
    message = error.get("message") if isinstance(error, dict) else error or data.get("detail")
    return " ".join(str(message).split())[:160] if message else None


def _ids(data: Mapping[str, Any], key: str, url: str) -> list[int]:
    ids = data.get(key)
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise EngineRefusedError(f"{url} answered without a list of token ids")
    return list(ids)


def json_object(response: httpx.Response) -> dict[str, Any]:
    """The JSON object an endpoint answered ({} for anything else: not JSON, a list)."""
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
