"""A canned OpenAI-style upstream, and how tests search a store for secrets.

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
from typing import Any

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


class CannedUpstream:
    """An OpenAI-style server with fixed answers; `seen` holds each request's path, headers, body.

    POST /v1/chat/completions answers CANNED_STREAM when `stream` is true,
    else CANNED_TEXT_COMPLETION when the last message is a tool result, else
    CANNED_COMPLETION. A request whose last message says "hang" (a stream:
    after its first two events) waits until `release` is set, then gets
    the rest of its answer; one whose client left meanwhile is listed in
    `abandoned` and gets nothing more.
    A model named "missing" gets a 404 error body.
    """

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.abandoned: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _hang(self) -> bool:
                """Wait for `release`; False when the client closed the connection first."""
                while not server.release.wait(0.02):
                    readable, _, _ = select.select([self.connection], [], [], 0)
                    if readable and not self.connection.recv(1, socket.MSG_PEEK):
                        server.abandoned.append(self.path)
                        return False
                return True

            def _headers(self) -> dict[str, str]:
                return {k.lower(): v for k, v in self.headers.items()}

            def do_GET(self) -> None:
                server.seen.append({"path": self.path, "headers": self._headers()})
                self._send(200, CANNED_MODELS, "application/json")

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.seen.append({"path": self.path, "headers": self._headers(),
                                    "body": data})
                if self.path.split("?")[0] == "/v1/embeddings":
                    self._send(200, CANNED_EMBEDDING, "application/json")
                    return
                body = json.loads(data)
                if body.get("model") == "missing":
                    self._send(404, b'{"error":{"message":"no such model","type":'
                               b'"invalid_request_error","code":"model_not_found"}}',
                               "application/json")
                    return
                last = body["messages"][-1]
                if last.get("content") == "hang" and not body.get("stream"):
                    if self._hang():
                        self._send(200, CANNED_COMPLETION, "application/json")
                    return
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    events = CANNED_STREAM[:2] if last.get("content") == "hang" else CANNED_STREAM
                    for event in events:
                        self.wfile.write(event)
                        self.wfile.flush()
                    if last.get("content") == "hang" and self._hang():
                        for event in CANNED_STREAM[2:]:  # released: the rest of the stream
                            self.wfile.write(event)
                        self.wfile.flush()
                    return
                answer = CANNED_TEXT_COMPLETION if last["role"] == "tool" else CANNED_COMPLETION
                self._send(200, answer, "application/json")

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> CannedUpstream:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self._httpd.shutdown()
        self._httpd.server_close()


def all_blob_bytes(store: Any) -> list[bytes]:
    """The content of every blob of the store (decompressed: a secret must not hide in a frame)."""
    import sqlalchemy as sa

    from kvtrace.store import codec
    from kvtrace.store.schema import blobs

    with store.engine.connect() as conn:
        return list(codec.read(conn, conn.execute(sa.select(blobs.c.hash)).scalars()).values())


def all_step_meta(store: Any) -> list[str]:
    """Every step's stored metadata, as text."""
    import sqlalchemy as sa

    from kvtrace.store.schema import steps

    with store.engine.connect() as conn:
        return [str(row) for row in conn.execute(sa.select(steps))]
