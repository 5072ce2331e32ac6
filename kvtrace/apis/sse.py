"""Server-sent events of any provider API: the events of a stream read, and written.

`events` and `json_events` read the events of any SSE stream; `encode_event`
writes one in the `event:`/`data:` form Anthropic and the Responses API use;
`Assembled` is what a stream of such an API adds up to. Each API's module
(chat.py, anthropic.py, responses.py) assembles and writes its own events.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


def events(data: bytes) -> Iterator[bytes]:
    """The `data:` payloads of an SSE byte stream, one per event, in order."""
    text = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    for block in text.split(b"\n\n"):
        lines = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines:
            yield b"\n".join(lines)


def json_events(data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON object of each event of a stream; ValueError when one is not a JSON object.

    A last event cut before its end (no blank line after it, data that does
    not parse) is dropped: it never arrived whole.
    """
    payloads = list(events(data))
    is_terminated = data.replace(b"\r\n", b"\n").endswith(b"\n\n")
    for number, payload in enumerate(payloads, 1):
        try:
            event = json.loads(payload)
        except ValueError:
            if number == len(payloads) and not is_terminated:
                return
            raise
        if not isinstance(event, dict):
            raise ValueError("an SSE event's data is not a JSON object")
        yield event


def encode_event(event: Mapping[str, Any]) -> bytes:
    """One `event: TYPE` / `data: JSON` block, as Anthropic and the Responses API send them."""
    return (f"event: {event['type']}\ndata: ".encode()
            + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


@dataclass(frozen=True, slots=True)
class Assembled:
    """What the events of a provider's stream add up to (Anthropic, Responses)."""

    response: dict[str, Any]  # the one non-streamed response the events make
    is_finished: bool  # the API's terminal event arrived (False: the stream was cut)
    error: dict[str, Any] | None = None  # an `error` event's body: the stream failed
    unknown_events: tuple[str, ...] = ()  # event types skipped, as the providers ask
