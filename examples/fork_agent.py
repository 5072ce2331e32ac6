"""An unchanged openai-SDK agent of ten model calls whose tool writes a file.

The agent `kvtrace record --from RUN@K` forks (docs/fork.md): it knows
nothing of kvtrace. It talks to whatever `OPENAI_BASE_URL` names (`kvtrace
record` sets it), asks for `gpt-4o-mini` as an agent written for OpenAI
would, and after each answer runs its own tool, `write_note`, which
appends the answer to `notes.txt` in the working folder and reports what
it wrote. The next request carries that report. Its requests depend only
on the answers it got, so answered the same, it asks the same.

    kvtrace record --run base -- python examples/fork_agent.py
    kvtrace record --from base@6 -- python examples/fork_agent.py
    kvtrace record --from base@6 --n 4 --workdir 'runs/{i}' -- python "$PWD/examples/fork_agent.py"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import openai

TOOLS = [{"type": "function", "function": {
    "name": "write_note", "description": "Append a line to notes.txt.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}}}]


def write_note(folder: Path, text: str) -> str:
    """The agent's tool: a side effect kvtrace does not replay (docs/fork.md)."""
    with (folder / "notes.txt").open("a", encoding="utf-8") as notes:
        # One line, whatever breaks the text: sampled text may hold \r, \x0b, \u2028 …
        notes.write(" ".join(text.splitlines()) + "\n")
    return json.dumps({"wrote_chars": len(text)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--folder", type=Path, default=Path.cwd())
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="above 0: sampled (`record --n K` gives each copy its seed)")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "system", "content": "You keep short notes about the sea."},
                {"role": "user", "content": "Write the first note about the sea."}]
    for turn in range(args.calls):
        reply = client.chat.completions.create(
            model=args.model, messages=messages, tools=TOOLS, max_tokens=8,
            temperature=args.temperature)
        text = reply.choices[0].message.content or ""
        call_id = f"call_{turn}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function", "function": {
                "name": "write_note", "arguments": json.dumps({"text": text})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": write_note(args.folder, text)})
    print(f"{args.calls} calls, notes in {args.folder / 'notes.txt'}")


if __name__ == "__main__":
    main()
