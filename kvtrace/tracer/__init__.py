"""The tracer: record any agent's model calls, tool calls and HTTP exchanges into a run.

- `recording(store, name)` / `Recorder`: the Python API (record calls by
  hand; `@rec.tool` and `tool` for the current recording record each call
  of a tool function);
- `RecordingTransport` / `AsyncRecordingTransport`: transports that record
  every exchange of an httpx- or httpx2-based client (the OpenAI and
  Anthropic SDKs take an `http_client`; clients.py), chat completions,
  Anthropic Messages and OpenAI Responses calls as model_call steps, plain
  or streamed (capture.py, endpoints.py, the API modules of kvtrace/apis);
- `ReplayTransport` / `AsyncReplayTransport`: their twins that answer from
  the recording (VCR-like modes `none`, `new_episodes`, `all`);
- `replaying(run, until=K)`: the tracer's replay mode, in which the
  `tool` functions and the recording transports are answered from a run's
  steps 1..K, then go live on a fork (replay_mode.py).

`kvtrace serve`, the recording HTTP server, is `kvtrace.serve`: it records
through this package (capture.py decides what an exchange becomes).

Layering: imports the store only (tests/test_layers.py); never the engine,
replay, the server or the CLI. The transports load httpx on first use, so
`import kvtrace` (which re-exports `recording` and `tool`) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtrace.tracer.context import current_recorder, current_replaying
from kvtrace.tracer.recorder import Recorder, recording
from kvtrace.tracer.replay_mode import Replaying, replaying
from kvtrace.tracer.tools import tool

if TYPE_CHECKING:
    from kvtrace.tracer.cassette import AsyncReplayTransport, CassetteMode, ReplayTransport
    from kvtrace.tracer.transport import AsyncRecordingTransport, RecordingTransport

_LAZY = {
    "AsyncReplayTransport": "kvtrace.tracer.cassette",
    "CassetteMode": "kvtrace.tracer.cassette",
    "ReplayTransport": "kvtrace.tracer.cassette",
    "AsyncRecordingTransport": "kvtrace.tracer.transport",
    "RecordingTransport": "kvtrace.tracer.transport",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtrace.tracer' has no attribute {name!r}")

__all__ = [
    "AsyncRecordingTransport",
    "AsyncReplayTransport",
    "CassetteMode",
    "Recorder",
    "RecordingTransport",
    "ReplayTransport",
    "Replaying",
    "current_recorder",
    "current_replaying",
    "recording",
    "replaying",
    "tool",
]
