"""Record a ReAct agent, fork it with an edited tool result, continue the fork, replay both.

    python examples/react_agent.py [--store URL] [--cache-dir DIR] [--model PATH]

1. Records a run "agent" with the default model (SmolLM2-135M-Instruct): a
   short session of questions answered with two deterministic tools
   (`calculator`, `lookup`), every model call and tool call a step. (A
   135M-parameter model is not a good agent: expect odd answers.)
2. Forks it at a tool call and records an edited result there (the store is
   append-only: the edit is a new step on the fork).
3. Continues the fork live for a few steps; its prompts share the parent's
   prefix, so only the tokens after the edit are computed.
4. Replays both runs on an EMPTY cache (a fresh cache folder): the parent in
   rebuild mode with the uncached comparison, then the fork in verify mode,
   which reuses the parent's prefix; prints the reports and the analysis.

Everything goes to a temporary folder unless --store / --cache-dir say
otherwise; the converted model itself is cached under $KVTRACE_CACHE (or
~/.cache/kvtrace) so later runs load it in about a second. Runs in a few
minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rich.console import Console

from kvtrace import Store, open_store
from kvtrace.cli.render import render_analysis, render_replay
from kvtrace.engine import open_cache
from kvtrace.paths import default_cache_dir
from kvtrace.replay import SamplingParams, analyze, continue_run, replay
from kvtrace.replay.local import LocalBackend, open_local_backend
from kvtrace.replay.tools import DEMO_TOOLS, ask_demo_agent

QUESTIONS = [
    "Which country is Lima in?",
    "What is 12 times 12?",
    "How many people live in Oslo?",
]
PARAMS = SamplingParams(max_new_tokens=48)  # greedy: the run is reproducible
console = Console()


def free_name(taken: set[str]) -> str:
    """agent, agent-1, agent-2, …: the first whose run and whose fork are both new."""
    number = 0
    while (name := f"agent-{number}" if number else "agent") in taken or f"{name}-edit" in taken:
        number += 1
    return name


def record_agent(store: Store, backend: LocalBackend, name: str) -> None:
    """A session: each question is a new user turn in the same, growing conversation."""
    for number, question in enumerate(QUESTIONS):
        result = ask_demo_agent(store, name, backend, question, params=PARAMS,
                                is_first=number == 0)
        calls = [f"{s.meta['tool']}({s.content['arguments']!r})" for s in result.new_steps
                 if s.kind == "tool_call"]
        console.print(f"[bold]{question}[/bold] tools: {', '.join(calls) or 'none'}; "
                      f"answer: {result.final_answer!r}", highlight=False)


def fork_with_edit(store: Store, parent: str, name: str) -> None:
    """Fork before a tool result of `parent` and record an edited result there.

    The edit is a lookup whose country is changed (or, failing that, the
    middle tool call with its result replaced): the fork's answer can differ.
    """
    tools = [s for s in store.path(parent) if s.kind == "tool_call"]
    if not tools:
        raise SystemExit("the model made no tool call: nothing to edit (try another --model)")
    looked_up = [s for s in tools if isinstance(s.content["result"], dict)]
    original = looked_up[0] if looked_up else tools[len(tools) // 2]
    result = original.content["result"]
    edited = {**result, "country": "Chile"} if isinstance(result, dict) else 1000000
    fork = store.fork(original.parent_id or "", name)  # at the model call that asked
    fork.record_tool_call(original.meta["tool"], original.content["arguments"], edited)
    console.print(f"forked {name!r} at step {original.depth - 1} of {parent!r}: "
                  f"{original.meta['tool']} now returns {edited!r} (was {result!r})",
                  highlight=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", help="store URL, or 'default' for the store of the "
                        "kvtrace command (.kvtrace/ here or $KVTRACE_HOME); default: a "
                        "temporary SQLite file")
    parser.add_argument("--cache-dir", type=Path,
                        help="folder for KV blocks (default: temporary folders)")
    parser.add_argument("--model", help="a transformers model folder (default: embedded)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvtrace-demo-") as tmp:
        root = Path(tmp)
        if args.store == "default":
            store = open_store()
        else:
            store = open_store(args.store or f"sqlite:///{root / 'store.db'}")
        name = free_name({info.name for info in store.runs()})
        fork_name = f"{name}-edit"
        kv_root = args.cache_dir or root
        backend = open_local_backend(args.model, cache_dir=default_cache_dir(),
                                     kv_dir=kv_root / "kv-recording")

        console.rule("1. record a ReAct agent")
        record_agent(store, backend, name)

        console.rule("2. fork with an edited tool result, 3. continue the fork")
        fork_with_edit(store, name, fork_name)
        result = continue_run(store, fork_name, backend, steps=2, tools=DEMO_TOOLS,
                              params=PARAMS)
        for r in result.reports:
            console.print(f"continued step @{r.depth}: {r.reused_tokens}/{r.prompt_tokens} "
                          f"prompt tokens reused, {r.computed_tokens} computed")
        console.print(f"the fork answers {result.final_answer!r}", highlight=False)

        console.rule("4. replay both on an empty cache")
        engine = backend.engine  # the same loaded model, with a new and empty cache
        fresh = LocalBackend(engine, open_cache(engine, disk_dir=kv_root / "kv-replay"))
        render_replay(replay(store, name, fresh, mode="rebuild", compare_uncached=True), console)
        console.print(f"The fork shares its first steps with {name!r}, whose KV the cache now "
                      "holds: they compute one token each, and the step after the edit only "
                      "what follows the edit. (Its oracle counts the fork's own calls only.)")
        render_replay(replay(store, fork_name, fresh, mode="verify"), console)
        render_analysis(analyze(store, fork_name, fresh.tokenizer), console)
        if args.store == "default":
            console.rule("next")
            console.print(f"The runs {name!r} and {fork_name!r} are in {store.display_url}. "
                          f"Try (with .venv/bin on PATH): kvtrace log {fork_name} --graph; "
                          f"kvtrace diff {name} {fork_name}; kvtrace replay {name} --mode "
                          f"verify; kvtrace analyze {name}", highlight=False)
        store.close()


if __name__ == "__main__":
    main()
