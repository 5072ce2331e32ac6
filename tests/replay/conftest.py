"""Fixtures for replay tests: stores, a byte-level tokenizer, a stand-in OpenAI server.

`ByteTokenizer` is a real (if simple) tokenizer with a ChatML-like template:
one token per UTF-8 byte plus two special tokens. It lets the oracle, analyze
and the remote backend be tested without loading a model. The stand-in
server speaks the OpenAI chat-completions API over a real loopback socket and
simulates an exact-prefix cache by brute force (every earlier sequence
compared), independently of kvtrace's own oracle.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

BOS, EOS = 256, 257


class ByteTokenizer:
    """<s>role\\ncontent</s>\\n per message; the generation prompt is <s>assistant\\n."""

    eos_token_ids = (EOS,)

    max_context_tokens = None

    def chat_tokens(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None):
        from kvtrace.rendering import template_messages

        messages, _ = template_messages(messages, tools, native=False)  # kvtrace's fallback rule
        ids: list[int] = []
        for message in messages:
            ids += [BOS, *f"{message['role']}\n{message['content']}".encode(), EOS, *b"\n"]
        if add_generation_prompt:
            ids += [BOS, *b"assistant\n"]
        return ids

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        out, chunk = [], bytearray()
        for token in ids:
            if token in (BOS, EOS):
                out.append(chunk.decode(errors="replace"))
                chunk = bytearray()
                if not skip_special_tokens:
                    out.append("<s>" if token == BOS else "</s>")
            else:
                chunk.append(token)
        out.append(chunk.decode(errors="replace"))
        return "".join(out)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _special_tokens(text: str) -> list[int]:
    """ByteTokenizer's ids of a rendered text, its <s> and </s> read as the special tokens
    (llama.cpp's /tokenize with parse_special)."""
    ids: list[int] = []
    for index, part in enumerate(text.split("<s>")):
        if index:
            ids.append(BOS)
        for inner, piece in enumerate(part.split("</s>")):
            if inner:
                ids.append(EOS)
            ids += list(piece.encode())
    return ids


# What `failure(body)` may answer instead of a completion: (status, headers), or DROP to
# close the connection without any answer.
Failure = tuple[int, dict[str, str]] | str | None
DROP = "drop"


class StandInServer:
    """An OpenAI-compatible chat-completions server on 127.0.0.1 with a simulated prefix cache.

    Requests are served on a thread each. `failure(body)`, when given, may
    fail a request (see `Failure`; every call is counted in `attempts`).
    `hold_first_until=K` keeps the first request waiting until K requests have
    arrived (at most 10 s): a client that sends nothing concurrently waits out
    that time, one that does is let through at once. `max_in_flight` is the
    most requests that were in the server at one time.
    """

    def __init__(
        self,
        answer: Callable[[list[dict[str, Any]]], str],
        *,
        reports_cached: bool = True,
        reports_usage: bool = True,
        fail_status: int | None = None,
        failure: Callable[[dict[str, Any]], Failure] | None = None,
        hold_first_until: int = 0,
        engine: str | None = None,
        page_size: int = 1,
        erase_status: int = 200,
        busy_first: int = 0,
    ) -> None:
        self.tokenizer = ByteTokenizer()
        self.engine = engine  # None: chat completions only; else ENGINE_SHAPES' endpoints
        self.page_size = page_size  # its cache reuses whole pages of this many tokens
        self.erase_status = erase_status  # llama.cpp: 501 without --slot-save-path
        self.busy_first = busy_first  # engine endpoint requests answered 503 first (warming up)
        self.num_resets = 0
        self.answer = answer
        self.reports_cached = reports_cached
        self.reports_usage = reports_usage  # False: answers carry no usage at all
        self.fail_status = fail_status
        self.failure = failure
        self.seen: list[list[int]] = []
        self.requests: list[dict[str, Any]] = []
        self.attempts: list[tuple[float, dict[str, Any]]] = []  # (arrival, body), failed too
        self.cached_answers: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.held_first = False  # whether the first request saw hold_first_until reached
        self._hold_until = hold_first_until
        self._arrived = threading.Condition()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers: a pool reuses sockets

            def do_GET(self) -> None:
                self.do_POST()

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                if self.path != "/v1/chat/completions":  # the engine's own endpoints, if any
                    with server._lock:
                        answered = server.engine_endpoint(self.command, self.path, body)
                    if answered is None:
                        self.send_error(404)
                        return
                    status, payload = answered
                    data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                server.enter(body)
                try:
                    failed = server.failure(body) if server.failure is not None else None
                    if failed == DROP:
                        self.close_connection = True
                        return
                    headers: dict[str, str] = {}
                    if isinstance(failed, tuple):
                        status, headers = failed
                        payload: dict[str, Any] = {"error": {"message": "stand-in failure"}}
                    else:
                        with server._lock:
                            status, payload = server.handle(self.path, body)
                finally:
                    server.leave()
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def enter(self, body: dict[str, Any]) -> None:
        with self._arrived:
            self.attempts.append((time.monotonic(), body))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self._arrived.notify_all()
            if len(self.attempts) == 1 and self._hold_until:
                self.held_first = self._arrived.wait_for(
                    lambda: len(self.attempts) >= self._hold_until, timeout=10)

    def leave(self) -> None:
        with self._arrived:
            self.in_flight -= 1

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if path != "/v1/chat/completions":
            return 404, {"error": {"message": f"no route {path}"}}
        if self.fail_status is not None:
            return self.fail_status, {"error": {"message": "stand-in failure"}}
        self.requests.append(body)
        prompt = self.tokenizer.chat_tokens(body["messages"])
        cached = max((_lcp(prompt, s) for s in self.seen), default=0)
        cached = min(cached, len(prompt) - 1)
        cached -= cached % self.page_size
        text = self.answer(body["messages"])[: max(1, int(body.get("max_tokens", 256)))]
        if body.get("max_tokens") == 1:
            text = text[:1]
        full = self.tokenizer.chat_tokens(
            [*body["messages"], {"role": "assistant", "content": text}], False
        )
        self.seen.append(full[: len(prompt) + len(text.encode()) + 1])
        self.cached_answers.append(cached)
        usage: dict[str, Any] = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(text.encode()) + 1,
            "total_tokens": len(prompt) + len(text.encode()) + 1,
        }
        if self.reports_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return 200, {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": text},
                }
            ],
            **({"usage": usage} if self.reports_usage else {}),
        }

    def engine_endpoint(self, method: str, path: str, body: dict[str, Any]
                        ) -> tuple[int, Any] | None:
        """The endpoints of the engine shape `engine` ("sglang", "llama.cpp") besides chat
        completions, as that engine answers them; None: no such route (a 404)."""
        if self.engine is None:
            return None
        if self.busy_first > 0:
            self.busy_first -= 1
            return 503, {"error": {"message": "loading"}}
        route = (method, path.split("?")[0])
        if self.engine == "sglang":  # /tokenize of text only; a page size; /flush_cache
            if route == ("POST", "/tokenize"):
                if "prompt" not in body:
                    return 400, {"detail": "prompt: field required"}
                return 200, {"tokens": self.tokenizer.encode(body["prompt"])}
            if route == ("GET", "/get_server_info"):
                return 200, {"page_size": self.page_size, "model_path": "stand-in"}
            if route == ("POST", "/flush_cache"):
                self.seen.clear()
                self.num_resets += 1
                return 200, "Cache flushed."
        if self.engine == "llama.cpp":  # the template as text, then its tokens; slot erase
            if route == ("POST", "/apply-template"):
                ids = self.tokenizer.chat_tokens(body["messages"])
                return 200, {"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)}
            if route == ("POST", "/tokenize"):
                return 200, {"tokens": _special_tokens(body["content"])}
            if route == ("GET", "/slots"):
                return 200, [{"id": 0}, {"id": 1}]
            if method == "POST" and path.startswith("/slots/") and "action=erase" in path:
                if self.erase_status != 200:
                    return self.erase_status, {"error": {"message": "not supported"}}
                self.seen.clear()
                self.num_resets += 1
                return 200, {"id_slot": int(path.split("/")[2].split("?")[0]), "n_erased": 1}
        return None

    def __enter__(self) -> StandInServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture
def stand_in_server() -> Iterator[Callable[..., StandInServer]]:
    """A factory: `stand_in_server(answer, reports_cached=..., fail_status=..., failure=...,
    hold_first_until=...)`, started."""
    started: list[StandInServer] = []

    def make(answer: Callable[[list[dict[str, Any]]], str], **options: Any) -> StandInServer:
        server = StandInServer(answer, **options).__enter__()
        started.append(server)
        return server

    yield make
    for server in started:
        server.__exit__(None, None, None)


@pytest.fixture
def replay_store(tmp_path) -> Iterator[Any]:
    """An empty SQLite store in a temporary folder, for tests of replay's own logic.

    Tests of what replay writes and reads back (record, replay, fork, continue,
    branch, a second writer) take `store` (tests/conftest.py) instead: one
    empty store on each backend, SQLite and PostgreSQL (a fresh schema).
    """
    from kvtrace import open_store

    store = open_store(f"sqlite:///{tmp_path / 'store.db'}")
    yield store
    store.close()


# -- engine-backed fixtures ----------------------------------------------------------------


@pytest.fixture(scope="session")
def default_model_folder():
    """The converted default model (converted once into the kvtrace cache, then reused)."""
    from kvtrace.engine import default_model_dir
    from kvtrace.paths import default_cache_dir

    return default_model_dir(default_cache_dir())


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, default_model_folder):
    """A tiny random Llama with the default model's tokenizer: fast, deterministic."""
    from kvtrace.engine import build_tiny_model, load_engine

    root = tmp_path_factory.mktemp("tiny-model")
    folder = build_tiny_model(root / "model", tokenizer_dir=default_model_folder, seed=3)
    return load_engine(folder, cache_dir=root / "cache")


@pytest.fixture(scope="session")
def default_engine(default_model_folder):
    from kvtrace.engine import load_engine
    from kvtrace.paths import default_cache_dir

    return load_engine(None, cache_dir=default_cache_dir())


@pytest.fixture
def local_backend_factory(tmp_path):
    """`make(engine, kv_dir=None, memory_bytes=...)`: a LocalBackend on a fresh KV cache."""
    from kvtrace.engine import open_cache
    from kvtrace.replay.local import LocalBackend

    def make(engine, kv_dir=None, **options):
        return LocalBackend(engine, open_cache(engine, disk_dir=kv_dir or tmp_path / "kv",
                                               **options))

    return make


@pytest.fixture
def kvtrace_serve(tmp_path) -> Iterator[Callable[..., Any]]:
    """`kvtrace_serve(local_backend, store=None)`: `kvtrace serve` in local mode, started.

    The one place these tests build the server: `make_server` answering with
    `local_backend`, recording into `store` (a
    fresh SQLite store by default), served by uvicorn on a free loopback
    port; `.url` is its base URL (with /v1).
    """
    from kvtrace import open_store
    from kvtrace.serve import BackgroundServer, make_server

    servers: list[Any] = []
    stores: list[Any] = []

    def start(backend: Any, store: Any = None) -> Any:
        if store is None:
            store = open_store(f"sqlite:///{tmp_path / f'serve{len(stores)}.db'}")
            stores.append(store)
        server = make_server(backend=backend, store=store)
        running = BackgroundServer(server.app).start()
        servers.append(running)
        return running

    yield start
    for running in servers:
        running.stop()
    for store in stores:
        store.close()
