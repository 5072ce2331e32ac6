"""Tool-calling conversations in the shape real agent harnesses write, made here.

`tool_calling_conversation(num_calls)` builds, deterministically from a seed,
what a tau-bench or mini-swe-agent style agent sends over `num_calls` model
calls: a long system prompt (a policy), a user task, then assistant turns
that call tools (``content: null`` with `tool_calls`, arguments a JSON
string), `role: "tool"` results of 100 to ~2,000 characters, an occasional
user follow-up and text answer. Each call's messages are the previous call's
messages plus its response and what followed, as every harness sends them.

`agent_document(num_calls, seed=, shape=)` gives one whole run as the
document the OpenAI importer reads (`kvtrace import --format openai`): the
tau-bench shape above, or a SWE-agent shape (an issue to fix, then bash
commands whose outputs run from one line to a few KB, each model call with a
short thought and a `usage` in mini-swe-agent's `extra.response`).

Used by `kvtrace bench store` (bytes stored over distinct message bytes),
`kvtrace bench scale` (a store of many such runs) and by tests; nothing here
is copied from a real trajectory.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from kvtrace.apis import ProviderApi, anthropic, responses

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_reservation_details",
            "description": "Get the details of a reservation.",
            "parameters": {
                "type": "object",
                "properties": {"reservation_id": {"type": "string"}},
                "required": ["reservation_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_direct_flight",
            "description": "Search direct flights between two cities on a date.",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string"},
                    "destination": {"type": "string"},
                    "date": {"type": "string"},
                },
                "required": ["origin", "destination", "date"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the repository and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
]

_POLICY = (
    "# Airline agent policy\n"
    "You are a customer service agent for an airline. Help users book, modify or cancel "
    "reservations. Before taking an action that changes the booking database, list the "
    "action's details and obtain explicit user confirmation (yes) to proceed. Make at most "
    "one tool call at a time; if you call a tool, do not respond to the user in the same "
    "turn. Deny requests that are against this policy.\n"
)
_CITIES = ["SFO", "JFK", "LAX", "ORD", "SEA", "BOS", "DEN", "ATL", "MIA", "PHX"]
_FILES = ["src/core.py", "src/utils.py", "tests/test_core.py", "README.md", "setup.cfg"]


@dataclass(frozen=True, slots=True)
class Call:
    """One recorded model call: what was sent and what came back."""

    messages: list[dict[str, Any]]
    response: dict[str, Any]
    tools: list[dict[str, Any]]
    usage: dict[str, Any]
    results: list[tuple[str, str, Any, str]]  # (call id, tool, arguments, result) after it
    system: str | None = None  # Anthropic `system` / Responses `instructions` (in_api)


def tool_calling_conversation(num_calls: int, *, seed: int = 0) -> list[Call]:
    """`num_calls` model calls of one growing tool-calling conversation."""
    rng = random.Random(seed)
    system = _POLICY + "".join(
        f"- Rule {i}: {rng.choice(['economy', 'business', 'basic economy'])} fares "
        f"{rng.choice(['can', 'cannot'])} be changed within {rng.randint(1, 48)} hours; "
        f"baggage allowance is {rng.randint(0, 3)} bags.\n"
        for i in range(40)
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Hi, I want to change my flight from SFO to JFK, "
         "reservation ZFA04Y, to a later date."},
    ]
    calls: list[Call] = []
    response: dict[str, Any]
    prompt_chars = sum(len(json.dumps(m)) for m in messages)  # kept up to date as it grows
    for index in range(num_calls):
        usage = {
            "prompt_tokens": prompt_chars // 4,
            "completion_tokens": rng.randint(15, 60),
            "cached_tokens": (prompt_chars // 4) // 64 * 64 if index else 0,
        }
        if index % 7 == 6 or index == num_calls - 1:  # a text turn, then the user goes on
            response = {"role": "assistant",
                        "content": f"I found {rng.randint(1, 5)} options; shall I proceed "
                                   f"with option {rng.randint(1, 3)}? (turn {index})"}
            calls.append(Call(list(messages), response, TOOLS, usage, []))
            added = [response, {"role": "user", "content": rng.choice(
                ["yes", "Yes, go ahead.", "No, try another date."])}]
            messages = [*messages, *added]
            prompt_chars += sum(len(json.dumps(m)) for m in added)
            continue
        call_id = f"call_{seed}_{index:03d}"
        name, arguments, result = _tool_use(rng, index)
        response = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments)}}],
        }
        calls.append(Call(list(messages), response, TOOLS, usage,
                          [(call_id, name, arguments, result)]))
        added = [response,
                 {"role": "tool", "tool_call_id": call_id, "name": name, "content": result}]
        messages = [*messages, *added]
        prompt_chars += sum(len(json.dumps(m)) for m in added)
    return calls


def in_api(calls: list[Call], api: ProviderApi) -> list[Call]:
    """The same calls spoken in another provider API: its own messages, tools and usage.

    Converted with the store's own inverse mappings (anthropic.py, responses.py
    `from_chat`), so the conversation means the same in every API.
    """
    if api is ProviderApi.OPENAI_CHAT:
        return calls
    module = anthropic if api is ProviderApi.ANTHROPIC_MESSAGES else responses
    out = []
    for call in calls:
        system, messages = module.from_chat(call.messages)
        finish = "tool_calls" if call.response.get("tool_calls") else "stop"
        prompt, cached = call.usage["prompt_tokens"], call.usage["cached_tokens"]
        usage: dict[str, Any] = (
            {"input_tokens": prompt - cached, "cache_read_input_tokens": cached,
             "cache_creation_input_tokens": 0, "output_tokens": call.usage["completion_tokens"]}
            if module is anthropic else
            {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
             "output_tokens": call.usage["completion_tokens"]})
        out.append(Call(messages, module.response_from_chat(call.response, finish),
                        _tools_in(call.tools, api), usage, call.results, system))
    return out


def _tools_in(tools: list[dict[str, Any]], api: ProviderApi) -> list[dict[str, Any]]:
    functions = [t["function"] for t in tools]
    if api is ProviderApi.ANTHROPIC_MESSAGES:
        return [{"name": f["name"], "description": f["description"],
                 "input_schema": f["parameters"]} for f in functions]
    return [{"type": "function", **f} for f in functions]


def _tool_use(rng: random.Random, index: int) -> tuple[str, dict[str, Any], str]:
    """A tool name, its arguments and a result of realistic size."""
    kind = index % 3
    if kind == 0:
        reservation = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(6))
        result = json.dumps({
            "reservation_id": reservation,
            "user_id": f"user_{rng.randint(1000, 9999)}",
            "flights": [{"origin": rng.choice(_CITIES), "destination": rng.choice(_CITIES),
                         "date": f"2024-05-{rng.randint(10, 28)}",
                         "price": rng.randint(80, 900), "status": "available",
                         "flight_number": f"HAT{rng.randint(100, 999)}"}
                        for _ in range(rng.randint(1, 4))],
            "cabin": rng.choice(["economy", "business"]), "insurance": rng.choice(["yes", "no"]),
            "created_at": f"2024-05-{rng.randint(1, 9):02d}T{rng.randint(0, 23):02d}:00:00",
            "passengers": [{"first_name": f"P{i}", "last_name": "Smith"}
                           for i in range(rng.randint(1, 3))],
            "payment_history": [{"payment_id": f"credit_card_{rng.randint(10**6, 10**7)}",
                                 "amount": rng.randint(100, 2000)}],
        })
        return "get_reservation_details", {"reservation_id": reservation}, result
    if kind == 1:
        origin, destination = rng.sample(_CITIES, 2)
        date = f"2024-05-{rng.randint(10, 28)}"
        flights = [{"flight_number": f"HAT{rng.randint(100, 999)}",
                    "scheduled_departure_time_est": f"{rng.randint(5, 22):02d}:00:00",
                    "available_seats": {"economy": rng.randint(0, 20),
                                        "business": rng.randint(0, 8)},
                    "prices": {"economy": rng.randint(90, 400),
                               "business": rng.randint(500, 1800)}}
                   for _ in range(rng.randint(2, 10))]
        return ("search_direct_flight",
                {"origin": origin, "destination": destination, "date": date},
                json.dumps(flights))
    path = rng.choice(_FILES)
    lines = "\n".join(f"{n:4d}  def handler_{n}(x):  # returns x + {rng.randint(1, 99)}"
                      for n in range(rng.randint(10, 60)))
    return ("bash", {"command": f"nl -ba {path} | sed -n 1,40p"},
            f"<returncode>0</returncode>\n<output>\n{lines}\n</output>")


SHAPES = ("tau", "swe")
_SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached"
_SWE_SYSTEM = (
    "You are a helpful assistant that can interact with a computer to solve tasks. "
    "You work in a repository checked out at /testbed. Run one bash command per turn with the "
    "`bash` tool; each command runs in a new subshell, so directory changes do not persist. "
    "Start by finding and reading the code relevant to the issue, write a script that "
    "reproduces it, edit the source to fix it, run the script again to confirm the fix, and "
    "think about edge cases. Do not modify the tests. When you are done, run "
    f"`{_SUBMIT}`.\n"
)
_WORDS = ("value", "result", "config", "parser", "node", "index", "cache", "request", "token",
          "path", "handler", "buffer", "session", "schema", "record", "field", "offset", "batch",
          "stream", "writer", "reader", "limit", "count", "error", "state", "item", "key")
_SWE_COMMANDS = ("grep -rn {w} src/ | head -40", "sed -n {a},{b}p src/{w}.py",
                 "python reproduce.py", "python -m pytest tests/test_{w}.py -x -q",
                 "ls -la src/{w}", "git diff", "cat src/{w}.py | nl | sed -n {a},{b}p")


def _source_lines(seed: int) -> list[str]:
    """A pool of code-like lines that command outputs are cut from (cheap to slice)."""
    rng = random.Random(seed)
    lines = []
    for n in range(2000):
        a, b = rng.sample(_WORDS, 2)
        lines.append(rng.choice([
            f"    def {a}_{b}(self, {b}):",
            f"        {a} = self.{b}.get({n}, None)",
            f"        if {a} is None or len({b}) > {rng.randint(1, 999)}:",
            f"            raise ValueError(f\"bad {a}: {{{b}!r}}\")",
            f"        return {{'{a}': {a}, '{b}': self._{b}[{n % 97}]}}",
            f"# {a} {b}: kept for {rng.choice(_WORDS)} compatibility (see #{n})",
        ]))
    return lines


_LINES = _source_lines(7)


def swe_messages(num_calls: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """A SWE-agent shaped run of `num_calls` model calls, as the whole message list."""
    rng = random.Random(seed)
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(150, 450)))
    issue = (f"<pr_description>\nIssue #{seed}: {rng.choice(_WORDS)} is lost when the "
             f"{rng.choice(_WORDS)} is empty.\n\n{words}\n</pr_description>")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": _SWE_SYSTEM},
        {"role": "user", "content": f"Fix the issue below in /testbed.\n{issue}"},
    ]
    prompt_chars = sum(len(m["content"]) for m in messages)
    for index in range(num_calls):
        word = rng.choice(_WORDS)
        start = rng.randrange(len(_LINES) - 80)
        count = rng.choice((1, 3, 8, 20, 40, 80))
        command = rng.choice(_SWE_COMMANDS).format(w=word, a=start, b=start + count)
        if index == num_calls - 1:
            command = _SUBMIT
        output = "\n".join(f"{start + i:6d}\t{line}" for i, line in
                           enumerate(_LINES[start:start + count]))
        call_id = f"call_{seed}_{index}"
        thought = (f"THOUGHT: step {index}: the {word} path; " + " ".join(
            rng.choice(_WORDS) for _ in range(rng.randint(10, 60))))
        usage = {"prompt_tokens": prompt_chars // 4, "completion_tokens": len(thought) // 4 + 20,
                 "prompt_tokens_details": {"cached_tokens": (prompt_chars // 4) // 64 * 64}}
        messages.append({
            "role": "assistant", "content": thought,
            "tool_calls": [{"id": call_id, "type": "function", "function": {
                "name": "bash", "arguments": json.dumps({"command": command})}}],
            "extra": {"response": {"model": "swe-bench-model", "usage": usage}},
        })
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": f"<returncode>0</returncode>\n<output>\n{output}\n</output>"})
        prompt_chars += len(thought) + len(command) + len(output) + 80
    return messages


def agent_document(num_calls: int, *, seed: int = 0, shape: str = "tau") -> dict[str, Any]:
    """One run of `num_calls` model calls as an OpenAI document (`model`, `tools`, `messages`).

    Importing it (`import_document(..., format="openai")`) gives a model_call
    step per call and a tool_call step per tool result: about two steps a call.
    """
    if shape == "swe":
        return {"model": "swe-bench-model", "tools": [TOOLS[2]],
                "messages": swe_messages(num_calls, seed=seed)}
    if shape != "tau":
        raise ValueError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    calls = tool_calling_conversation(num_calls, seed=seed)
    last = calls[-1]
    results = [{"role": "tool", "tool_call_id": call_id, "name": name, "content": result}
               for call_id, name, _, result in last.results]
    return {"model": "tau-bench-model", "tools": TOOLS,
            "messages": [*last.messages, last.response, *results]}
