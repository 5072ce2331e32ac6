"""The tests' one canned HTTP server, a canned OpenAI-style upstream, and how tests search a
store for secrets.

`CannedServer` is the one HTTP server the canned upstreams share (this
module's `CannedUpstream`, tests/canned_apis.py's Anthropic and Responses
servers, tests/serve/canned_proxied.py's): each answers its own requests.
`CannedUpstream` is a third-party-like OpenAI server (http.server, a
separate implementation) that answers with fixed bytes — odd spacing and
key order included, so "returned unchanged" means byte for byte — a
tool-calling completion, or the same as an SSE stream sent in pieces. The
tracer's transports and `kvtrace serve --upstream` are tested against it
(the `canned_upstream` fixture of tests/conftest.py).
"""

from __future__ import annotations

import json
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

SECRET_KEY = "sk-test-0123456789abcdefSECRET"

CANNED_COMPLETION = (
    b'{"id":"chatcmpl-canned-1", "object":"chat.completion","created":1700000000,'
    b'"model":"canned-model",  "system_fingerprint":"fp_canned",\n'
    b'"choices":[{"index":0,"finish_reason":"tool_calls","message":{"role":"assistant",'
    b'"content":null,"tool_calls":[{"id":"call_abc","type":"function","function":'
    b'{"name":"get_weather","arguments":"{\\"city\\": \\"Paris\\"}"}}]}}],'
    b'"usage":{"prompt_tokens":42,"completion_tokens":9,"total_tokens":51,'
    b'"prompt_tokens_details":{"cached_tokens":32}}}'
)
CANNED_TEXT_COMPLETION = (
    b'{"id":"chatcmpl-canned-2","object":"chat.completion","created":1700000001,'
    b'"model":"canned-model","choices":[{"index":0,"finish_reason":"stop","message":'
    b'{"role":"assistant","content":"It is sunny in Paris."}}],'
    b'"usage":{"prompt_tokens":60,"completion_tokens":7,"total_tokens":67}}'
)
_CHUNK = '{"id":"chatcmpl-canned-s","object":"chat.completion.chunk","created":1700000002,' \
    '"model":"canned-model","choices":[%s]%s}'
CANNED_STREAM = [
    ("data: " + _CHUNK % ('{"index":0,"delta":{"role":"assistant","content":""},'
                          '"finish_reason":null}', "") + "\n\n").encode(),
    ("data: " + _CHUNK % ('{"index":0,"delta":{"content":"Let me "},"finish_reason":null}', "")
     + "\n\n").encode(),
    ("data: " + _CHUNK % ('{"index":0,"delta":{"content":"check."},"finish_reason":null}', "")
     + "\n\n").encode(),
    ("data: " + _CHUNK % ('{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_s1",'
                          '"type":"function","function":{"name":"get_weather","arguments":'
                          '"{\\"city\\""}}]},"finish_reason":null}', "") + "\n\n").encode(),
    ("data: " + _CHUNK % ('{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
                          '{"arguments":": \\"Oslo\\"}"}}]},"finish_reason":null}', "")
     + "\n\n").encode(),
    ("data: " + _CHUNK % ('{"index":0,"delta":{},"finish_reason":"tool_calls"}', "")
     + "\n\n").encode(),
    ("data: " + _CHUNK % ("", ',"usage":{"prompt_tokens":40,"completion_tokens":12,'
                          '"total_tokens":52,"prompt_tokens_details":{"cached_tokens":16}}')
     + "\n\n").encode(),
    b"data: [DONE]\n\n",
]
CANNED_MODELS = b'{"object":"list","data":[{"id":"canned-model","object":"model"}]}'
CANNED_EMBEDDING = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5]}]}'


class Reply:
    """How a canned server answers one request: JSON, or an SSE stream that may hang."""

    def __init__(self, handler: BaseHTTPRequestHandler, server: CannedServer) -> None:
        self.handler = handler
        self.server = server

    def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        handler = self.handler
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def stream(self, events: list[bytes], *, hang: bool = False, rest: bool = False,
               no_cache: bool = False) -> None:
        """`events` as an SSE stream (HTTP/1.0: it ends when the connection closes). With
        `hang`, the first two, then a wait for `release`; with `rest`, the others after it."""
        handler = self.handler
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        if no_cache:
            handler.send_header("Cache-Control", "no-cache")
        handler.end_headers()
        for event in events[:2] if hang else events:
            handler.wfile.write(event)
            handler.wfile.flush()
        if hang and self.wait() and rest:
            for event in events[2:]:
                handler.wfile.write(event)
            handler.wfile.flush()

    def wait(self) -> bool:
        """Wait for the server's `release`; False when the client closed the connection first
        (its path is then listed in `abandoned`)."""
        connection = self.handler.connection
        while not self.server.release.wait(0.02):
            readable, _, _ = select.select([connection], [], [], 0)
            if readable and not connection.recv(1, socket.MSG_PEEK):
                self.server.abandoned.append(self.handler.path)
                return False
        return True


class CannedServer:
    """The one canned HTTP server of the tests: http.server on a free loopback port, written
    here (never kvtrace's own code), that notes each request in `seen` and hands it to
    `on_get` / `on_post` of a subclass, which answers through a `Reply`. `release` frees the
    requests a subclass made hang; `abandoned` lists those whose client left first."""

    prefix = "/v1"  # what `url` ends with

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.abandoned: list[str] = []
        self.num_calls = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _headers(self) -> dict[str, str]:
                return {k.lower(): v for k, v in self.headers.items()}

            def do_GET(self) -> None:
                server.seen.append({"path": self.path, "headers": self._headers()})
                server.on_get(Reply(self, server), self.path.split("?")[0])

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with server._lock:
                    server.num_calls += 1
                    number = server.num_calls
                server.seen.append({"path": self.path, "headers": self._headers(), "body": data})
                server.on_post(Reply(self, server), self.path.split("?")[0], data, number)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}{self.prefix}"

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def on_get(self, reply: Reply, path: str) -> None:
        reply.send(404, b'{"error": "no such path"}')

    def on_post(self, reply: Reply, path: str, data: bytes, number: int) -> None:
        """Answer a POST of `data` to `path`, the server's `number`th."""
        raise NotImplementedError


class CannedUpstream(CannedServer):
    """An OpenAI-style server with fixed answers; `seen` holds each request's path, headers, body.

    POST /v1/chat/completions answers CANNED_STREAM when `stream` is true,
    else CANNED_TEXT_COMPLETION when the last message is a tool result, else
    CANNED_COMPLETION. A request whose last message says "hang" (a stream:
    after its first two events) waits until `release` is set, then gets
    the rest of its answer; one whose client left meanwhile is listed in
    `abandoned` and gets nothing more.
    A model named "missing" gets a 404 error body.
    """

    def on_get(self, reply: Reply, path: str) -> None:
        reply.send(200, CANNED_MODELS)

    def on_post(self, reply: Reply, path: str, data: bytes, number: int) -> None:
        if path == "/v1/embeddings":
            reply.send(200, CANNED_EMBEDDING)
            return
        body = json.loads(data)
        if body.get("model") == "missing":
            reply.send(404, b'{"error":{"message":"no such model","type":'
                       b'"invalid_request_error","code":"model_not_found"}}')
            return
        last = body["messages"][-1]
        hang = last.get("content") == "hang"
        if body.get("stream"):
            reply.stream(CANNED_STREAM, hang=hang, rest=True)
        elif hang:
            if reply.wait():
                reply.send(200, CANNED_COMPLETION)
        else:
            reply.send(200, CANNED_TEXT_COMPLETION if last["role"] == "tool"
                       else CANNED_COMPLETION)


def all_blob_bytes(store: Any) -> list[bytes]:
    """The content of every blob of the store (decompressed: a secret must not hide in a frame)."""
    import sqlalchemy as sa

    from kvtrace.store.db.schema import blobs
    from kvtrace.store.objects import codec

    with store.engine.connect() as conn:
        return list(codec.read(conn, conn.execute(sa.select(blobs.c.hash)).scalars()).values())


def all_step_meta(store: Any) -> list[str]:
    """Every step's stored metadata, as text."""
    import sqlalchemy as sa

    from kvtrace.store.db.schema import steps

    with store.engine.connect() as conn:
        return [str(row) for row in conn.execute(sa.select(steps))]
