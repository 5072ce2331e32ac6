"""The benchmarks' fork agent: ten chat calls over a long system prompt, a tool that writes.

The loop of examples/fork_agent.py, spoken over httpx so the benchmarks
need no SDK, with a ~2,000-token system prompt (real agents' instructions
and tool documentation are longer). It is imported by `kvtrace bench fork`
and run as a program by `kvtrace bench fork --n K` (K agent processes, each
pointed at its server by `OPENAI_BASE_URL`, as `kvtrace record` points an
unchanged agent), so it imports nothing heavier than httpx:

    python -m kvtrace.bench.fork_agent --calls 10 --max-tokens 96 --temperature 0.8

`--tool-seconds S`: each tool call also takes S seconds, as real agents' do;
`--times FILE`: each model call's seconds, written as a JSON list at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

TOOLS = [{"type": "function", "function": {
    "name": "write_note", "description": "Append a line to notes.txt.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}}}]
# A coding agent's system prompt and tool documentation run to thousands of tokens; this
# one is ~2,000, the low end (the point: the prefix a fork does not recompute).
SYSTEM = "You keep short notes about the sea: tides, weather, boats, birds.\n" + "".join(
    f"Rule {i}: a note about {topic} names one place and one time of day, in under twenty "
    "words, and never repeats an earlier note.\n"
    for i, topic in enumerate(["tides", "weather", "boats", "birds", "fish", "storms",
                               "harbours", "lighthouses"] * 10))


def write_note(folder: Path, text: str) -> str:
    """The agent's tool: appends to notes.txt, says how much it wrote."""
    with (folder / "notes.txt").open("a", encoding="utf-8") as notes:
        # One line, whatever breaks the text: sampled text may hold \r, \x0b, \u2028 …
        notes.write(" ".join(text.splitlines()) + "\n")
    return json.dumps({"wrote_chars": len(text)})


def run_agent(url: str, folder: Path, *, calls: int, model: str = "gpt-4o-mini",
              max_tokens: int = 24, temperature: float = 0.0, tool_seconds: float = 0.0,
              call_seconds: list[float] | None = None) -> int:
    """The agent against `url` (a base URL with /v1); returns the completion tokens it was
    sent. Sampled when `temperature` > 0, sending no seed (the server chooses). Each tool
    call takes `tool_seconds` more, as a real agent's tools do (running tests, reading
    files): the time a fork's recorded prefix spends outside the model. Each model call's
    seconds are appended to `call_seconds`."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Write the first note about the sea."}]
    completion_tokens = 0
    with httpx.Client(base_url=url, timeout=3600) as client:
        for turn in range(calls):
            started = time.perf_counter()
            reply = client.post("/chat/completions", json={
                "model": model, "messages": messages, "tools": TOOLS,
                "max_tokens": max_tokens, "temperature": temperature})
            reply.raise_for_status()
            answer = reply.json()
            if call_seconds is not None:
                call_seconds.append(time.perf_counter() - started)
            completion_tokens += answer.get("usage", {}).get("completion_tokens", 0)
            text = answer["choices"][0]["message"].get("content") or ""
            call_id = f"call_{turn}"
            time.sleep(tool_seconds)
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": call_id, "type": "function", "function": {
                        "name": "write_note", "arguments": json.dumps({"text": text})}}]},
                {"role": "tool", "tool_call_id": call_id, "content": write_note(folder, text)},
                {"role": "user", "content": f"Now note {turn + 2}, about something else."}]
    return completion_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--tool-seconds", type=float, default=0.0)
    parser.add_argument("--times", type=Path, help="write each model call's seconds here (JSON)")
    args = parser.parse_args()
    seconds: list[float] = []
    run_agent(os.environ["OPENAI_BASE_URL"], Path.cwd(), calls=args.calls, model=args.model,
              max_tokens=args.max_tokens, temperature=args.temperature,
              tool_seconds=args.tool_seconds, call_seconds=seconds)
    if args.times is not None:
        args.times.write_text(json.dumps(seconds))


if __name__ == "__main__":
    main()
