"""An agent-shaped benchmark run, built deterministically in code.

Real tool-calling agents (mini-swe-agent, gemini-cli, Terminus-2) send many
calls whose prompts each grow by a tool result and a response over a long
shared prefix. This fixture has that shape:

- a ~1,500-token system prompt (tool descriptions and rules), then a task;
- `num_calls` model calls (30 by default); each response is the model's own
  greedy output (at most `RESPONSE_TOKENS` tokens), recorded with its token
  ids, so verify can accept it as a draft;
- after each call, a tool call whose observation is 20-400 tokens (mostly
  short, sometimes a long file or log: drawn from a seeded `random.Random`),
  sent back as the next user message, so the prompts grow from ~1.6k to past
  5k tokens.

Everything but the responses is fixed by `seed`; the responses are fixed by
the model (greedy, canonical prefill). The run is recorded once per model
fingerprint and recipe, then reused.
"""

from __future__ import annotations

import random
from typing import Any

from kvtrace.engine.sampling import SamplingParams
from kvtrace.replay.backend import CallRequest
from kvtrace.replay.local import LocalBackend
from kvtrace.replay.recording import assistant_message, record_generation
from kvtrace.store import Store

AGENT_RECIPE = "agent-v1"
NUM_CALLS = 30
RESPONSE_TOKENS = 24
SYSTEM_TOKENS = 1500
_TOOLS = [
    ("read_file", "path", "Print a file of the repository with line numbers."),
    ("list_dir", "path", "List a folder: names, sizes, modification times."),
    ("grep", "pattern", "Search the repository for a regular expression."),
    ("run_tests", "selector", "Run the test suite, or the tests matching a selector."),
    ("edit_file", "patch", "Apply a unified diff to the working tree."),
    ("shell", "command", "Run a shell command in the sandbox and return its output."),
    ("git_log", "range", "Show commits, newest first, with their messages."),
    ("search_docs", "query", "Search the project's documentation pages."),
]
_WORDS = [
    "cache", "prefix", "token", "block", "layer", "request", "handler", "retry", "timeout",
    "buffer", "index", "parser", "schema", "record", "replay", "commit", "branch", "worker",
    "queue", "session", "config", "value", "offset", "length", "stream", "socket", "client",
    "server", "module", "package", "import",
]


def system_prompt(tokenizer: Any, seed: int = 0) -> str:
    """Tool descriptions and rules, grown to about SYSTEM_TOKENS tokens."""
    rng = random.Random(seed)
    lines = [
        "You are a software engineering agent working in a sandboxed repository.",
        "Answer with exactly one tool call per turn, as `Action: TOOL ARGUMENT`.",
        "Tools:",
    ]
    for name, argument, purpose in _TOOLS:
        lines.append(f"- {name}({argument}): {purpose}")
    rule = 0
    while len(tokenizer.encode("\n".join(lines))) < SYSTEM_TOKENS:
        rule += 1
        words = " ".join(rng.choice(_WORDS) for _ in range(14))
        lines.append(f"Rule {rule}: before you change the {words}, read it and run the tests.")
    return "\n".join(lines)


def observation(tokenizer: Any, rng: random.Random, call: int) -> str:
    """A tool result of 20-400 tokens: mostly short, sometimes a long listing."""
    roll = rng.random()
    low, high = (20, 80) if roll < 0.6 else (80, 200) if roll < 0.85 else (200, 400)
    target = rng.randint(low, high)
    lines = [f"exit status {call % 3}"]
    while len(tokenizer.encode("\n".join(lines))) < target:
        module, line = rng.randint(1, 40), rng.randint(1, 900)
        words = " ".join(rng.choice(_WORDS) for _ in range(6))
        lines.append(f"src/pkg_{module}/mod_{line % 17}.py:{line}: {words}")
    text = "\n".join(lines)
    while len(tokenizer.encode(text)) > target and "\n" in text:
        text = text.rsplit("\n", 1)[0]
    return text


def record_agent_run(
    store: Store, name: str, backend: LocalBackend, *, num_calls: int = NUM_CALLS, seed: int = 0
) -> int:
    """Record the fixture as run `name`; returns the longest prompt in tokens."""
    engine = backend.engine
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=RESPONSE_TOKENS)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(engine, seed)},
        {"role": "user", "content": "Task: the replay of long runs is slow. Find out why and "
                                    "fix it without changing any result. Start by looking around."},
    ]
    run = store.run(name)
    longest = 0
    for call in range(num_calls):
        prompt = engine.chat_tokens(messages)
        longest = max(longest, len(prompt))
        result = backend.generate(CallRequest(messages=messages, prompt_ids=prompt, params=params))
        record_generation(run, messages, result, model=engine.name, params=params)
        tool, argument, _ = _TOOLS[rng.randrange(len(_TOOLS))]
        seen = observation(engine, rng, call)
        run.record_tool_call(tool, {"argument": f"{argument}-{call}"}, seen)
        messages = [
            *messages,
            assistant_message(result.text),
            {"role": "user", "content": f"Observation:\n{seen}"},
        ]
    return longest
