"""A small tool-calling conversation, recorded the way an agent records it (shared by tests).

`record_calc_run` writes three steps: a model call asking the `calc` tool,
the tool call with its result, and the model call answering with it. Forks
edit one of them to give a run whose first differing step is known.
"""

from __future__ import annotations

import json
from typing import Any

CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object"}}}
SYSTEM = {"role": "system", "content": "You are a careful calculator."}


def ask(question: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": question}]


def call(expr: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": "calc", "arguments": json.dumps({"expr": expr})}}]}


def record_calc_run(run, *, question: str = "What is 17 * 23?", expr: str = "17 * 23",
                    result: str = "391", usage: dict[str, Any] | None = None) -> None:
    """Model call -> tool call -> model call, as an agent with one tool records them."""
    asked = call(expr)
    run.record_model_call(ask(question), asked, model="gpt-4o", tools=[CALC],
                          usage=usage or {"prompt_tokens": 52, "completion_tokens": 9,
                                          "cached_tokens": 0, "finish_reason": "tool_calls"},
                          timings={"total_s": 0.8})
    record_answer(run, question, asked, result)


def record_answer(run, question: str, asked: dict[str, Any], result: str) -> None:
    """The tool call answering `asked` with `result`, then the model's final answer."""
    run.record_tool_call("calc", json.loads(asked["tool_calls"][0]["function"]["arguments"]),
                         result, call_id="call_1", timings={"duration_s": 0.01})
    tool_message = {"role": "tool", "tool_call_id": "call_1", "content": result}
    run.record_model_call([*ask(question), asked, tool_message], f"The answer is {result}.",
                          model="gpt-4o", tools=[CALC],
                          usage={"prompt_tokens": 80, "completion_tokens": 7,
                                 "cached_tokens": 64, "finish_reason": "stop"},
                          timings={"total_s": 0.5})
