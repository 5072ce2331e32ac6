"""Two deterministic tools for demos, tests and `kvtrace continue --tools demo`.

Deterministic on purpose: a replayed or continued run must be reproducible,
so these tools answer from their input alone (no clock, no network).
`calculator` evaluates arithmetic with Python's own parser restricted to
numbers and + - * / // % ** (never `eval`); `lookup` answers from a fixed
table of city facts.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtrace.engine.sampling import SamplingParams
    from kvtrace.replay.backend import Backend
    from kvtrace.replay.continuation import ContinueResult
    from kvtrace.store import Store

_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}

CITY_FACTS: dict[str, dict[str, Any]] = {
    "paris": {"country": "France", "population": 2102650},
    "rome": {"country": "Italy", "population": 2748109},
    "tokyo": {"country": "Japan", "population": 14192184},
    "lima": {"country": "Peru", "population": 10151200},
    "oslo": {"country": "Norway", "population": 717710},
}


def calculator(expression: Any) -> int | float:
    """Evaluate an arithmetic expression such as ``2102650*3``."""
    text = str(expression.get("expression", "")) if isinstance(expression, dict) else str(
        expression
    )
    tree = ast.parse(text.replace("\u00d7", "*").replace(",", "").strip(), mode="eval")
    return _evaluate(tree.body)


def lookup(query: Any) -> dict[str, Any] | str:
    """Facts about a city from a fixed table; the first known city named in `query`."""
    text = str(query.get("city", "")) if isinstance(query, dict) else str(query)
    words = "".join(c if c.isalpha() else " " for c in text.lower()).split()
    for word in words:
        if word in CITY_FACTS:
            return {"city": word.title(), **CITY_FACTS[word]}
    return f"no facts about {text!r}; known cities: {', '.join(c.title() for c in CITY_FACTS)}"


DEMO_TOOLS: dict[str, Callable[[Any], Any]] = {"calculator": calculator, "lookup": lookup}
DEMO_TOOL_DESCRIPTIONS: dict[str, str] = {
    "calculator": "evaluates arithmetic, e.g. 12*7",
    "lookup": "facts about a city (country, population), e.g. Paris",
}
_ROME = '{"city": "Rome", "country": "Italy", "population": 2748109}'
# Worked examples (question, tool, input, observation, answer): with these four,
# SmolLM2-135M-Instruct follows the ReAct format; with fewer it drifts.
DEMO_SHOTS: list[tuple[str, str, str, str, str]] = [
    ("What is 17 times 4?", "calculator", "17*4", "68", "68"),
    ("Which country is Rome in?", "lookup", "Rome", _ROME, "Italy"),
    ("How many people live in Rome?", "lookup", "Rome", _ROME, "2748109"),
    ("What is 100 divided by 4?", "calculator", "100/4", "25.0", "25.0"),
]


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")


def demo_messages(question: str, *, notes: str = "") -> list[dict[str, Any]]:
    """The opening prompt of a demo agent: system prompt, worked examples, the question."""
    from kvtrace.replay.toolcall import few_shot_messages, system_prompt

    return [
        {"role": "system", "content": system_prompt(DEMO_TOOL_DESCRIPTIONS, notes)},
        *few_shot_messages(DEMO_SHOTS),
        {"role": "user", "content": f"Question: {question}"},
    ]


def ask_demo_agent(
    store: Store,
    run: str,
    backend: Backend,
    question: str,
    *,
    params: SamplingParams,
    is_first: bool,
    notes: str = "",
) -> ContinueResult:
    """Put one question to the demo agent on `run`, with up to 3 model calls.

    The first question opens the conversation (`demo_messages`); later ones
    are the next user turn of the same, growing conversation.
    """
    from kvtrace.replay.continuation import continue_run

    if is_first:
        return continue_run(store, run, backend, steps=3, tools=DEMO_TOOLS, params=params,
                            messages=demo_messages(question, notes=notes))
    return continue_run(store, run, backend, steps=3, tools=DEMO_TOOLS, params=params,
                        user_message=f"Question: {question}")
