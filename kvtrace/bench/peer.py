"""A run and its forks replayed through kvtrace and through a peer server: `bench fork --peer`.

The workload is what a fork experiment sends a model server: a recorded run
and K forks of it taken at different steps (`fork_steps`), replayed side
by side, their calls interleaved (call 1 of each run, then call 2 of each,
...), as the requests of experiments running at once reach a server. The
run is kvtrace/bench/fork.py's ten-call agent (a ~2,000-token system prompt, a tool
that writes a file), recorded on the local engine; each fork is the same
agent run with `--from base@S` and an edited step S (its answer replaced),
so it parts from the run there and goes on live.

Both servers get the same prompts over loopback HTTP, through the same
client (replay's `RemoteBackend`, rebuild mode: each recorded prompt with
`max_tokens=1`, which is what a cache changes the cost of; a null content
sent as "", which llama.cpp's server requires):

- kvtrace: `kvtrace serve` on the local engine in its own process, as a
  user runs it (kvtrace/bench/servers.py), a new server with an empty KV cache each
  trial (the radix tree keeps every branch), sent the recorded requests;
- the peer: any OpenAI-compatible server, or vLLM's CPU build started here
  (`--peer vllm`, from `make bench-peers`), sent the conversation as
  kvtrace's template sees it, its token ids checked against kvtrace's through
  its /tokenize (a mismatch is refused), made cold before each trial by its
  cache reset, or by one unrelated prompt where it has none
  (peerserver.py); `cold_start` says, per trial, how, or that the trial
  found its prompts cached, which then is no figure.

`contend` busy processes (contend.py) run beside both sides' timed trials.
Trials alternate which goes first (kvtrace, peer; peer, kvtrace; ...); the
fastest of each counts, `speedup = peer_s / kvtrace_s`. The engine issue's
target is >= 1.5 against vLLM at each side's fastest dtype. `prompt_tokens`
says how many tokens each side's template made of the prompts;
`computed_tokens` (from kvtrace's tokenizer) is what an exact prefix cache
must compute with a radix tree (every earlier sequence) and with a single
slot (the previous request's only); `computed_tokens_reported` is what each
server's usage said it computed, per trial (its own tokenization; None when
it reports no cached tokens): vLLM caches whole blocks (128 tokens by
default), so it computes more than the radix tree's count.
"""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvtrace.bench.contend import contention
from kvtrace.bench.fork import record_agent
from kvtrace.bench.limits import machine_rates, prefill_bound_s
from kvtrace.bench.peerserver import PeerSide, Trial, timed_replay, without_null_content
from kvtrace.bench.servers import dtype_name, kvtrace_serve
from kvtrace.engine.model import resolve_dtype
from kvtrace.engine.sampling import SamplingParams
from kvtrace.paths import default_cache_dir
from kvtrace.replay.backend import CallRequest, Tokenizer
from kvtrace.replay.oracle import PrefixOracle, common_prefix_length
from kvtrace.replay.recording import prompt_ids, step_messages, step_tools
from kvtrace.replay.remote import RemoteBackend
from kvtrace.store import ModelCall, Step, StepKind, Store, open_store

FORK_STEPS = (2, 4, 6, 8)


def run_peer_bench(peer: str, *, model: str | None = None, peer_model: str | None = None,
                   calls: int = 10, fork_steps: tuple[int, ...] = FORK_STEPS,
                   trials: int = 2, dtype: str = "float32", peer_block_size: int | None = None,
                   contend: int = 0) -> dict[str, Any]:
    """Time the interleaved replay through kvtrace and through `peer` (module docstring): a
    base URL, or "vllm" for vLLM's CPU build from `make bench-peers`, started here."""
    from kvtrace.engine import load_engine, open_cache
    from kvtrace.replay.local import LocalBackend

    if not fork_steps or any(not 1 <= s < calls for s in fork_steps):
        raise ValueError(f"fork steps must be in 1..{calls - 1}")
    engine = load_engine(model)  # the workload is recorded in float32 either way
    dtype = dtype_name(dtype)  # "auto" as this machine resolves it, for both servers
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = open_store(f"sqlite:///{root / 'bench.db'}")
        recording = LocalBackend(engine, open_cache(engine))  # warm across the recordings
        runs = record_forks(store, recording, root, calls=calls, fork_steps=fork_steps)
        schedule = interleaved(store, list(runs))
        single_slot, radix = computed_tokens(engine, schedule)
        rates = machine_rates(resolve_dtype(dtype, engine.device))  # quiet, before any load
        bound_s = prefill_bound_s(engine, computed_spans(engine, schedule),
                                  rates["gemm_gflops"] * 1e9)
        with ExitStack() as stack:
            peer_side = PeerSide(stack, peer, engine=engine, schedule=schedule, folder=root,
                                 model=model, peer_model=peer_model, dtype=dtype,
                                 block_size=peer_block_size)
            token_check = peer_side.check()
            stack.enter_context(contention(contend))
            ours: list[Trial] = []
            for trial in range(trials):
                if trial % 2:
                    peer_side.trial()
                with kvtrace_serve(root / f"serve-{trial}", model=model,
                                   cache_dir=default_cache_dir(), dtype=dtype) as url, \
                        RemoteBackend(url, model=engine.name) as client:
                    ours.append(timed_replay(
                        client, [_request(step_messages(s), s) for s in schedule],
                        cold_by="a new server"))
                if not trial % 2:
                    peer_side.trial()
        store.close()
    sides = {"kvtrace": ours, "peer": peer_side.trials}
    kvtrace_s = min((t.seconds for t in ours if t.is_figure(0)), default=None)
    peer_s = peer_side.fastest_cold_s()
    return {
        "model": engine.name, "dtype": dtype, "peer": peer_side.url, "calls": calls,
        "fork_steps": list(fork_steps), "contend": contend,
        "requests": len(schedule), "trials": trials,
        "forks": {name: run for name, run in runs.items() if run},
        "kvtrace_s": _r(kvtrace_s), "peer_s": _r(peer_s),
        "kvtrace_s_trials": [round(t.seconds, 3) for t in sides["kvtrace"]],
        "peer_s_trials": [round(t.seconds, 3) for t in sides["peer"]],
        "speedup": None if peer_s is None or kvtrace_s is None else round(peer_s / kvtrace_s,
                                                                          3),
        "target_speedup": 1.5,
        # The machine's best: the radix tree's computed tokens at its GEMM rate (limits.py).
        "bound": {**rates, "prefill_bound_s": round(bound_s, 3),
                  "kvtrace_over_bound": None if kvtrace_s is None else round(kvtrace_s / bound_s,
                                                                             2)},
        "prompt_tokens": {"kvtrace": sides["kvtrace"][0].prompt_tokens,
                          "peer": sides["peer"][0].prompt_tokens},
        "peer_tokens": token_check.to_dict(),
        "computed_tokens": {"radix_tree": radix, "single_slot": single_slot},
        "computed_tokens_reported": {side: [t.computed for t in got]
                                     for side, got in sides.items()},
        "cold_start": {"kvtrace": [t.cold_start(0) for t in ours],
                       "peer": peer_side.cold_starts()},
    }


def record_forks(store: Store, backend: Any, root: Path, *, calls: int,
                 fork_steps: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """Record `base` and one fork of it per step in `fork_steps`: each run's name (base
    first) and, for a fork, what its `--from` summary says."""
    record_agent(store, backend, root / "base", "base", calls=calls)
    runs: dict[str, dict[str, Any]] = {"base": {}}
    for step in fork_steps:
        name = f"fork-{step}"
        edit = {"response": {"role": "assistant",
                             "content": f"Fork {step}: the tide turns at noon in Brest."}}
        _, server = record_agent(store, backend, root / name, name, calls=calls,
                                 from_run=f"base@{step}", edit=edit)
        summary = server.answerer.summary
        runs[name] = {"served": summary.num_served, "first_live_step": summary.first_live_step}
    return runs


def interleaved(store: Store, runs: list[str]) -> list[Step]:
    """The runs' model calls, call 1 of each run, then call 2 of each, and so on."""
    calls = [[s for s in store.path(run) if s.kind == StepKind.MODEL_CALL] for run in runs]
    longest = max(len(c) for c in calls)
    return [c[i] for i in range(longest) for c in calls if i < len(c)]


def computed_tokens(tokenizer: Tokenizer, schedule: list[Step]) -> tuple[int, int]:
    """Prompt tokens an exact-prefix cache computes for `schedule`: (single slot, radix tree).

    As a server does: at least the last token of each prompt is computed.
    """
    single = 0
    previous: list[int] = []
    for step in schedule:
        ids = prompt_ids(tokenizer, step)
        single += len(ids) - min(common_prefix_length(ids, previous), len(ids) - 1)
        previous = ids
    return single, sum(end - start for start, end in computed_spans(tokenizer, schedule))


def computed_spans(tokenizer: Tokenizer, schedule: list[Step]) -> list[tuple[int, int]]:
    """The positions a radix-tree cache computes of each prompt of `schedule`, as (start,
    end): past the longest prefix any earlier prompt had, the last token at least."""
    spans = []
    seen = PrefixOracle()
    for step in schedule:
        ids = prompt_ids(tokenizer, step)
        spans.append((min(seen.longest_prefix(ids).length, len(ids) - 1), len(ids)))
        seen.add(ids)
    return spans


def _r(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _request(messages: list[Any], step: Step) -> CallRequest:
    messages = without_null_content(messages)
    return CallRequest(messages, None, SamplingParams(max_new_tokens=1),
                       model=ModelCall(step).model, tools=step_tools(step))
