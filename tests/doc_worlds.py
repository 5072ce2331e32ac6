"""What the docs' hidden `<!-- doc-test: setup -->` blocks build on (tests/test_doc_snippets.py).

A doc snippet often starts from a state the reader already has: the runs
`make demo` leaves, a trajectory file, a model folder. These helpers make that
state in the snippet's working folder, with the tiny random model the doc
tests load in place of the embedded one (`kvtrace.engine.load_engine()` is
that model while a doc snippet runs), so replaying what they record
reproduces it token for token.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TINY_MODEL: Path | None = None  # the doc tests' tiny model folder, set by their fixture

DEMO_QUESTION = "How many people live in Lima, times 2?"
DEMO_TOOL_CALLS = (("lookup", "Lima"), ("calculator", "10151200*2"))


def record_demo_agent(store: Any, name: str = "agent", *, fork: str | None = "agent-edit") -> None:
    """A ReAct run like `examples/react_agent.py` records, and its fork at the first tool call.

    The run is model call, lookup, model call, calculator, model call (5
    steps): each response is what the loaded model generates greedily, so
    `kvtrace replay --mode verify` reproduces the run; the tool calls are
    scripted (a random model asks for none) and their results are the demo
    tools' own. The fork, like the demo's, records an edited lookup result.
    """
    from kvtrace.engine import load_engine
    from kvtrace.replay import SamplingParams
    from kvtrace.replay.backend import CallRequest
    from kvtrace.replay.local import LocalBackend
    from kvtrace.replay.recording import record_generation
    from kvtrace.replay.toolcall import observation_message
    from kvtrace.replay.tools import DEMO_TOOLS, demo_messages

    backend = LocalBackend(load_engine(), None)
    params = SamplingParams(max_new_tokens=16)
    run = store.run(name)
    conversation = demo_messages(DEMO_QUESTION)
    for tool, argument in (*DEMO_TOOL_CALLS, (None, None)):
        prompt = backend.engine.chat_tokens(conversation)
        result = backend.generate(CallRequest(conversation, prompt, params))
        step = record_generation(run, conversation, result, model=backend.model, params=params)
        if tool is None:
            break
        answer = DEMO_TOOLS[tool](argument)
        run.record_tool_call(tool, argument, answer)
        conversation = [*conversation, step.content["response"], observation_message(answer)]
    if fork is not None:
        edited = store.fork(f"{name}@1", fork)
        edited.record_tool_call("lookup", "Lima", {"city": "Lima", "country": "Chile",
                                                   "population": 10151200})


def link_tiny_model(folder: str) -> Path:
    """`folder` in the working folder, a link to the tiny model folder (a model to name)."""
    if TINY_MODEL is None:
        raise RuntimeError("link_tiny_model runs inside the doc tests only")
    os.symlink(TINY_MODEL, folder)
    return Path(folder)
