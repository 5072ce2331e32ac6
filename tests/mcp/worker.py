"""The worker of test_supervisor.py: a scripted agent appending to a run, as the ReAct agent of
examples/supervisor.py does with a model.

Asked about Lima, it calls a `lookup` tool that answers from a stale table
(every population lost: 0); seeing 0, it asks again, and again: only a fixed
result lets it answer. Each next step follows from its run's head alone, so
it can go on from any head, a supervisor's fork included.

As a well-behaved writer it respects a supervisor: while its run is paused
it waits; when its run was moved under it (a conflict: nothing was written),
it reads the supervisor's note on the new head, `continue on run NAME`, and
goes on there.

    python tests/mcp/worker.py STORE_URL RUN
"""

from __future__ import annotations

import json
import sys
import time

from kvtrace import ConflictError, Run, Step, open_store
from kvtrace.replay.tools import CITY_FACTS
from kvtrace.store import ModelCall, StepKind, ToolCall

QUESTION = "Which country is Lima in, and how many people live there?"
HANDOFF = "continue on run "
MAX_STEPS = 200
PACE_S = 0.05  # between appends: a supervisor has time to look


def stale_lookup(city: str) -> dict[str, object]:
    return {"city": city.title(), **CITY_FACTS[city.lower()], "population": 0}


def ask_lookup(number: int) -> dict[str, object]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{number}", "type": "function",
         "function": {"name": "lookup", "arguments": json.dumps({"city": "Lima"})}}]}


def act(run: Run) -> bool:
    """Append the step that follows the run's head; False when the run has its answer."""
    head = run.head
    if head is None:
        run.record_model_call([{"role": "user", "content": QUESTION}], ask_lookup(1),
                              model="scripted")
        return True
    if head.kind == StepKind.MODEL_CALL:
        response = ModelCall(head).response
        if not response.get("tool_calls"):
            return False  # answered
        call = response["tool_calls"][0]
        city = json.loads(call["function"]["arguments"])["city"]
        run.record_tool_call("lookup", {"city": city}, stale_lookup(city), call_id=call["id"])
        return True
    result = ToolCall(head).result
    asked = ModelCall(_parent(run, head))
    messages = [*asked.messages, asked.response,
                {"role": "tool", "tool_call_id": ToolCall(head).call_id,
                 "content": json.dumps(result)}]
    if result["population"] == 0:
        reply = ask_lookup(head.depth)  # nobody lives there? look again
    else:
        reply = {"role": "assistant", "content": f"Lima is in {result['country']}; "
                 f"{result['population']} people live there."}
    run.record_model_call(messages, reply, model="scripted")
    return True


def _id(step: Step | None) -> str | None:
    return step.id if step is not None else None


def _parent(run: Run, step: Step) -> Step:
    return run.store.show(step.parent_id or "")


def main(url: str, name: str) -> int:
    store = open_store(url)
    run = store.run(name)
    for _ in range(MAX_STEPS):
        try:
            if not act(run):
                print(f"worker: answered on {run.name}: {ModelCall(run.head).response}",
                      flush=True)
                return 0
        except ConflictError as exc:  # paused, or moved by the supervisor: nothing written
            print(f"worker: {type(exc).__name__} on {run.name}", flush=True)
            run = follow(store, run)
        time.sleep(PACE_S)
    print("worker: no answer", flush=True)
    return 1


def follow(store, run: Run) -> Run:
    """After a conflict: wait out a pause, then go on here, or where the supervisor's note says."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if store.is_paused(run.name):
            time.sleep(PACE_S)
            continue
        head = store.head(run.name)
        if _id(head) == _id(run.head):
            return run  # only paused: the same head, go on
        notes = [n.text for n in store.notes(head.id)] if head is not None else []
        handoff = [text for text in notes if text.startswith(HANDOFF)]
        if handoff:
            print(f"worker: continuing on {handoff[-1][len(HANDOFF):]}", flush=True)
            return store.run(handoff[-1][len(HANDOFF):])
        time.sleep(PACE_S)
    raise SystemExit("worker: moved with no note saying where to go on")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
