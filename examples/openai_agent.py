"""An agent written with the official openai SDK and function calling, recorded two ways.

The agent (`run_agent`) is plain openai-SDK code: it knows nothing of kvtrace.

1. Through `kvtrace serve`, without touching the agent: `kvtrace record` starts
   a recording server (the local SmolLM2 engine, or `--upstream URL` for a real
   provider) and points OPENAI_BASE_URL at it:

       kvtrace record --run weather -- python examples/openai_agent.py
       kvtrace replay weather             # replays the recorded run at the oracle bound

2. Through `RecordingTransport` (one line: the SDK's `http_client`), then the
   same agent re-run offline with `ReplayTransport`, which answers from the
   recording and fails on any request it never saw:

       python examples/openai_agent.py --transport

   With OPENAI_BASE_URL unset, the example starts its own `kvtrace serve` on
   the default model as the "provider" (any OpenAI-compatible server works).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import httpx
import openai

QUESTION = "Weather in Oslo?"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]


def get_weather(city: str) -> str:
    return {"paris": "sunny, 21 C", "oslo": "snow, -3 C"}.get(city.lower(), "unknown city")


def calculate(expression: str) -> str:
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        return "error: only arithmetic"
    return str(eval(expression, {"__builtins__": {}}))  # digits and operators only


FUNCTIONS = {"get_weather": get_weather, "calculate": calculate}


def _worked_example(city: str, weather: str, call_id: str) -> list[dict[str, Any]]:
    """One earlier turn that used a tool: small models follow the pattern they are shown."""
    return [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": weather},
        {"role": "assistant", "content": f"It is {weather} in {city}."},
    ]


def run_agent(client: openai.OpenAI, model: str, *, max_turns: int = 4) -> str:
    """Ask, run every tool call the model makes, feed the results back, until it answers."""
    messages: list[dict[str, Any]] = [
        *_worked_example("Paris", "sunny", "call_ex1"),
        *_worked_example("Rome", "rainy", "call_ex2"),
        {"role": "user", "content": QUESTION},
    ]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                               temperature=0, max_tokens=48)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            print(f"  tool call: {call.function.name}({call.function.arguments})")
            function = FUNCTIONS.get(call.function.name)
            try:
                arguments = json.loads(call.function.arguments or "{}")
                result = function(**arguments) if function else "error: no such tool"
            except (TypeError, ValueError, SyntaxError, ZeroDivisionError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "(no answer within the turn limit)"


def model_of(client: openai.OpenAI) -> str:
    return os.environ.get("OPENAI_MODEL") or client.models.list().data[0].id


def with_transports(store_url: str | None) -> None:
    """Record through RecordingTransport, then re-run offline with ReplayTransport."""
    from kvtrace import open_store
    from kvtrace.tracer import RecordingTransport, ReplayTransport

    provider = None
    base_url = os.environ.get("OPENAI_BASE_URL")
    if not base_url:  # no provider configured: our own server on the default model
        from kvtrace.paths import default_cache_dir
        from kvtrace.replay import open_local_backend
        from kvtrace.serve import BackgroundServer, make_server

        backend = open_local_backend(None, cache_dir=default_cache_dir())
        provider = BackgroundServer(make_server(backend=backend).app).start()  # records nothing
        base_url = provider.url
    api_key = os.environ.get("OPENAI_API_KEY", "kvtrace")
    store = open_store(store_url)
    names = {info.name for info in store.runs()}
    name = next(n for n in ("openai-agent", *(f"openai-agent-{i}" for i in range(1, 10_000)))
                if n not in names)
    try:
        live = openai.OpenAI(base_url=base_url, api_key=api_key, http_client=httpx.Client(
            transport=RecordingTransport(store.run(name))))
        model = model_of(live)
        answer = run_agent(live, model)
        print(f"recorded run {name!r} ({len(store.path(name))} steps): {answer!r}")
    finally:
        if provider is not None:
            provider.stop()
    offline = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                            http_client=httpx.Client(transport=ReplayTransport(store.run(name))))
    replayed = run_agent(offline, model)
    print(f"replayed offline from the recording: {replayed!r}")
    if replayed != answer:
        raise SystemExit("the offline replay answered differently")
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", action="store_true",
                        help="record with RecordingTransport, then replay offline")
    parser.add_argument("--store", default=None,
                        help="store URL for --transport (default: .kvtrace/store.db)")
    args = parser.parse_args()
    if args.transport:
        with_transports(args.store)
        return
    client = openai.OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY, as `kvtrace record` sets them
    print(run_agent(client, model_of(client)))


if __name__ == "__main__":
    main()
