"""Replay benchmark: hit rate against the oracle, speed-up, distance to the lower bound.

One process, one model, side by side:

1. a ReAct session recorded once with the engine (long system prompt, one
   question after another, prompts growing past 2,000 tokens), then reused
   from the bench folder; `warm_hit_rate` replays it on the cache the
   recording left (same process when just recorded, else its disk tier);
2. rebuild on an EMPTY cache (fresh folder): `hit_rate` vs `oracle_hit_rate`,
   `rebuild_s_cached`; the same rebuild with no cache: `rebuild_s_uncached`;
3. verify on another empty cache: `verify_s_cached`, against
   `verify_lower_bound_s`: a single live DynamicCache that is cropped to each
   prompt's shared prefix, so only the tokens outside the oracle bound are
   computed (in one chunk, no padding, no copying, no disk), plus the
   recorded output fed one token per forward as decoding does. No cache that
   decodes can beat that. Verify checks each recorded response as a draft in
   one prefill, so it does not decode when the response matches: it can beat
   the bound, and `verify_decode_s_cached` (verify with `use_drafts=False`, every
   response decoded token by token) shows what the cache machinery costs a
   decoding replay against the same bound;
4. `feed_lower_bound_s`: the same bound with each output fed in the prompt's
   forward instead of decoded, the floor for rebuild and for verify with
   accepted drafts (`rebuild_ratio_to_feed_bound`, `verify_ratio_to_feed_bound`;
   `rebuild_ratio_to_feed_bound_pair_median`: each trial's rebuild over the
   same trial's bound, the median, steadier on a noisy machine).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvtrace.bench.agent import AGENT_RECIPE, NUM_CALLS, record_agent_run
from kvtrace.bench.limits import decode_bound_s, machine_rates, prefill_bound_s
from kvtrace.bench.peer import computed_spans
from kvtrace.bench.peerserver import PeerSide
from kvtrace.bench.rss import PeakRss, runtime_rss_mb
from kvtrace.bench.servers import dtype_name
from kvtrace.replay import SamplingParams, replay
from kvtrace.replay.local import LocalBackend
from kvtrace.replay.oracle import common_prefix_length
from kvtrace.replay.recording import expected_output_ids, step_messages
from kvtrace.replay.report import ReplayReport
from kvtrace.replay.tools import CITY_FACTS, ask_demo_agent
from kvtrace.store import StepKind, Store, open_store

MIN_PROMPT_TOKENS = 2000
MIN_MODEL_CALLS = 14
# Bump when the recorded session changes, so an old recording is not reused.
RECIPE = "v2"
_QUESTIONS = [
    "Which country is Lima in?", "What is 12 times 12?", "How many people live in Oslo?",
    "What is 2102650 divided by 2?", "Which country is Tokyo in?", "What is 345 plus 655?",
    "How many people live in Paris?", "What is 81 minus 19?", "Which country is Oslo in?",
    "What is 7 to the power 3?", "How many people live in Lima?", "What is 1000 times 3?",
    "Which country is Paris in?", "What is 99 times 99?", "How many people live in Tokyo?",
]
_PARAMS = SamplingParams(max_new_tokens=32)


def reference_notes() -> str:
    """A deterministic reference section that makes the system prompt ~1,500 tokens."""
    lines = ["Reference notes (use the tools for exact figures):"]
    for number in range(1, 41):
        city = sorted(CITY_FACTS)[number % len(CITY_FACTS)]
        facts = CITY_FACTS[city]
        lines.append(
            f"Note {number}: {city.title()} is a city in {facts['country']}; "
            f"its registry entry {number * 37 % 1000:03d} lists about "
            f"{facts['population'] // 1000} thousand residents."
        )
    return "\n".join(lines)


def record_session(store: Store, name: str, backend: LocalBackend) -> int:
    """Record questions until a prompt passes MIN_PROMPT_TOKENS; returns model calls."""
    calls, longest = 0, 0
    for number, question in enumerate(_QUESTIONS):
        result = ask_demo_agent(store, name, backend, question, params=_PARAMS,
                                is_first=number == 0, notes=reference_notes())
        calls += len(result.reports)
        longest = max([longest, *(r.prompt_tokens for r in result.reports)])
        if longest > MIN_PROMPT_TOKENS and calls >= MIN_MODEL_CALLS:
            break
    return calls


def lower_bound_seconds(store: Store, spec: str, engine: Any, *,
                        decode: bool = True) -> tuple[float, int]:
    """Seconds to compute only the tokens no cache could hold, and their count.

    One DynamicCache lives across the whole run: each prompt crops it to the
    prefix it shares with it and computes the rest in one forward. Its layers
    grow in place (kvbuffer.py), as kvtrace's do: transformers' own grow by
    copying the whole KV at every call, a cost the bound should not pay. With
    `decode`, the output is then fed one token per forward, as decoding does
    (the last token's forward is not counted: generation never runs it);
    without, it goes in the same forward as the prompt, as rebuild feeds it
    (the floor for rebuild and for verify with accepted drafts).
    """
    import torch

    from kvtrace.engine.kvbuffer import growing_cache

    model, device = engine.model, engine.device
    kv = growing_cache(model.config)

    def forward(ids: list[int]) -> None:
        model(input_ids=torch.tensor([ids], device=device), cache=kv, use_cache=True,
              logits_to_keep=1)

    live: list[int] = []
    seconds, computed = 0.0, 0
    with torch.inference_mode():
        for step in store.path(spec):
            if step.kind != StepKind.MODEL_CALL:
                continue
            prompt = engine.chat_tokens(step_messages(step))
            output = expected_output_ids(step, engine, prompt)
            shared = min(common_prefix_length(prompt, live), len(prompt) - 1)
            if shared < len(live):
                kv.crop(shared - len(live))
            started = time.perf_counter()
            if not decode:
                forward(prompt[shared:] + output)
                seconds += time.perf_counter() - started
            else:
                forward(prompt[shared:])
                for token in output[:-1]:
                    forward([token])
                seconds += time.perf_counter() - started
                if output:
                    forward(output[-1:])
            computed += len(prompt) - shared
            live = prompt + output
    return seconds, computed


SHAPES = ("session", "agent")


def run_replay_bench(*, cache_dir: Path, model: str | None = None, fresh: bool = False,
                     trials: int = 2, shape: str = "session", run: str | None = None,
                     store_url: str | None = None, calls: int | None = None,
                     with_verify: bool = True, dtype: str = "float32",
                     peer: str | None = None, peer_model: str | None = None,
                     peer_block_size: int | None = None) -> dict[str, Any]:
    """Replay a long agent run side by side in every mode; one dict of measurements.

    The run is `run` in the store at `store_url` (any recorded or imported
    run), else the `shape` fixture, recorded once under `cache_dir/bench/replay`
    and reused: "session" (the ReAct session above) or "agent"
    (`kvtrace.bench.agent`, `calls` model calls). Every timed case runs
    `trials` times, the cases interleaved, and the fastest trial counts: on a
    shared 2-core machine another process can slow one trial several-fold,
    never speed one up. The uncached rebuild, by far the slowest case, runs
    once on the agent shape and on a given run.

    `peer` (a base URL, or "vllm": vLLM's CPU build, started here) adds the same
    rebuild through that server (`peer_s`, `peer_speedup` = peer_s over
    rebuild_s_cached): each recorded prompt with `max_tokens=1`, as `replay
    --backend URL` sends it, the conversation as kvtrace's template sees it, its
    tokens checked through the peer's /tokenize, the peer made cold before each of
    its trials, which take turns with the cold rebuild's (peerserver.py).
    """
    from kvtrace.engine import load_engine, open_cache

    if shape not in SHAPES:
        from kvtrace.errors import UsageError

        raise UsageError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    runtime_mb = runtime_rss_mb()  # the interpreter and libraries, before any weight
    engine = load_engine(model, cache_dir=cache_dir, dtype=dtype)
    dtype = dtype_name(engine.dtype)  # "auto" as resolved, for a peer
    root = cache_dir / "bench" / "replay"
    if fresh and root.exists() and run is None:
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    store = open_store(store_url) if run is not None else open_store(
        f"sqlite:///{root / 'store.db'}")
    load_before = os.getloadavg()[0]
    try:
        recorded_now, record_s = False, 0.0
        warm: ReplayReport | None = None
        if run is not None:
            name = run
        elif shape == "agent":
            name = f"{AGENT_RECIPE}-{calls or NUM_CALLS}-{engine.fingerprint[:12]}"
            if name not in {r.name for r in store.runs()}:
                with tempfile.TemporaryDirectory(prefix="kvtrace-bench-") as tmp:
                    recording = open_cache(engine, disk_dir=Path(tmp) / "kv")
                    started = time.perf_counter()
                    record_agent_run(store, name, LocalBackend(engine, recording),
                                     num_calls=calls or NUM_CALLS)
                    record_s, recorded_now = time.perf_counter() - started, True
                    recording.flush()
                    del recording
        else:
            name = f"session-{RECIPE}-{engine.fingerprint[:12]}"
            recorded_now = name not in {r.name for r in store.runs()}
            recorder = LocalBackend(engine, open_cache(engine, disk_dir=root / "kv-recording"))
            if recorded_now:
                started = time.perf_counter()
                record_session(store, name, recorder)
                record_s = time.perf_counter() - started
            warm = replay(store, name, recorder, mode="rebuild")
            del recorder
        schedule = [s for s in store.path(name) if s.kind == StepKind.MODEL_CALL]
        rates = machine_rates(engine.dtype)  # before the cases, on a machine as quiet
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:  # vLLM stops first
            peer_side = None
            if peer is not None:
                peer_side = PeerSide(stack, peer, engine=engine, schedule=schedule,
                                     folder=Path(tmp), model=model, peer_model=peer_model,
                                     dtype=dtype, block_size=peer_block_size)
            figures = _measure(store, name, engine, trials=trials, warm=warm,
                               uncached_trials=trials if shape == "session" and run is None
                               else 1, with_verify=with_verify, peer=peer_side)
        bound_s = prefill_bound_s(engine, computed_spans(engine, schedule),
                                  rates["gemm_gflops"] * 1e9)
    finally:
        store.close()
    # The machine's best (limits.py): the computed tokens at its GEMM rate, a decode step
    # at its read bandwidth.
    figures["bound"] = {
        **rates, "prefill_bound_s": round(bound_s, 3),
        "rebuild_over_bound": round(figures["rebuild_s_cached"] / bound_s, 2),
        "decode_step_bound_ms": round(decode_bound_s(engine, rates["bandwidth_gb_s"] * 1e9)
                                      * 1e3, 2)}
    figures["runtime_rss_mb"] = round(runtime_mb, 1)
    figures.update(shape=shape if run is None else "run", recorded_now=recorded_now,
                   record_s=round(record_s, 3))
    figures["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return figures


def _measure(store: Store, name: str, engine: Any, *, trials: int, warm: ReplayReport | None,
             uncached_trials: int, with_verify: bool,
             peer: PeerSide | None = None) -> dict[str, Any]:
    """Every case on run `name`, interleaved trials; the figures of the fastest."""
    from kvtrace.engine import open_cache

    cases: dict[str, list[Any]] = {
        "cold": [], "uncached": [], "verify": [], "verify_decode": [], "bound": [],
        "feed_bound": [], "warm": [],
    }
    rss: list[tuple[float, float]] = []
    memory_peak = budget = 0
    _touch_weights(engine)
    resident = runtime_rss_mb()  # runtime and the whole model, before any case ran
    # The first run-length computation of a process is 15-30 % slower than
    # the next, whichever it is (docs/benchmarks.md): one untimed feed bound
    # first, so that the first trial's rebuild does not pay that alone.
    lower_bound_seconds(store, name, engine, decode=False)
    token_check = peer.check() if peer is not None else None
    for trial in range(max(1, trials)):
        if peer is not None and trial % 2:
            peer.trial()  # the peer first on odd trials, second on even ones
        with tempfile.TemporaryDirectory(prefix="kvtrace-bench-") as tmp:
            cache = open_cache(engine, disk_dir=Path(tmp) / "rebuild")
            with PeakRss() as peak:
                cases["cold"].append(replay(store, name, LocalBackend(engine, cache),
                                            mode="rebuild"))
            if peer is not None and not trial % 2:
                peer.trial()
            rss.append((peak.mb, peak.start_mb))
            memory_peak = max(memory_peak, cache.memory_stats().num_bytes)
            budget = cache.memory_stats().max_bytes or 0
            if warm is None:
                cases["warm"].append(replay(store, name, LocalBackend(engine, cache),
                                            mode="rebuild"))
            cache.flush()
            del cache
            if trial < uncached_trials:
                cases["uncached"].append(
                    replay(store, name, LocalBackend(engine, None), mode="rebuild"))
            if with_verify:
                checking = open_cache(engine, disk_dir=Path(tmp) / "verify")
                cases["verify"].append(replay(store, name, LocalBackend(engine, checking),
                                              mode="verify"))
                decoding = open_cache(engine, disk_dir=Path(tmp) / "decode")
                cases["verify_decode"].append(replay(store, name, LocalBackend(engine, decoding),
                                                     mode="verify", use_drafts=False))
                checking.flush()
                decoding.flush()
                del checking, decoding  # or their trees would count in the next trial's RSS
        if with_verify:
            cases["bound"].append(lower_bound_seconds(store, name, engine))
        cases["feed_bound"].append(lower_bound_seconds(store, name, engine, decode=False))
    cold = min(cases["cold"], key=_wall)
    figures = _figures(
        engine, name, warm if warm is not None else cases["warm"][0], cold,
        min(cases["uncached"], key=_wall),
        min(cases["verify"], key=_wall) if with_verify else None,
        min(cases["verify_decode"], key=_wall) if with_verify else None,
        min(cases["bound"]) if with_verify else None, min(cases["feed_bound"])[0],
    )
    figures["trials"] = len(cases["cold"])
    for case, key in (("cold", "rebuild_s_cached"), ("uncached", "rebuild_s_uncached"),
                      ("verify", "verify_s_cached"), ("verify_decode", "verify_decode_s_cached")):
        figures[f"{key}_trials"] = [round(r.wall_s, 3) for r in cases[case]]
    figures["verify_lower_bound_s_trials"] = [round(b[0], 3) for b in cases["bound"]]
    figures["feed_lower_bound_s_trials"] = [round(b[0], 3) for b in cases["feed_bound"]]
    # Each trial's rebuild over the bound measured in the same trial: on a noisy
    # machine their median says more than the fastest over the fastest.
    pairs = [r.wall_s / b[0] for r, b in zip(cases["cold"], cases["feed_bound"], strict=True)]
    figures["rebuild_ratio_to_feed_bound_pairs"] = [round(x, 3) for x in pairs]
    figures["rebuild_ratio_to_feed_bound_pair_median"] = round(statistics.median(pairs), 3)
    figures.update(_memory_figures(engine, cold, rss, resident, memory_peak, budget))
    if peer is not None and token_check is not None:
        peer_s = peer.fastest_cold_s()
        figures.update({
            "peer": peer.url, "peer_s": None if peer_s is None else round(peer_s, 3),
            "peer_s_trials": [round(t.seconds, 3) for t in peer.trials],
            "peer_speedup": None if peer_s is None else round(peer_s / cold.wall_s, 3),
            "target_peer_speedup": 1.5,
            "peer_tokens": token_check.to_dict(),
            "peer_prompt_tokens": peer.trials[0].prompt_tokens,
            "peer_computed_tokens": [t.computed for t in peer.trials],
            "peer_cold_start": peer.cold_starts(),
        })
    return figures


def _touch_weights(engine: Any) -> None:
    """One small forward: every weight page resident before RSS is first read."""
    from kvtrace.engine import prefill

    prefill(engine, None, [0] * 16)


def _memory_figures(engine: Any, cold: ReplayReport, rss: list[tuple[float, float]],
                    resident: float, memory_peak: int, budget: int) -> dict[str, Any]:
    """Peak RSS of the cached rebuild against weights + 1.5 x longest KV + memory tier.

    Three bounds (docs/cache.md, "Process memory"): the issue's formula, with
    the parameter bytes as the weights and the memory tier's configured
    budget (`rss_bound_mb`); the same with what the tier held at its peak in
    place of the budget (`rss_bound_tier_peak_mb`: it leaves out the Python,
    torch and transformers runtime); and that one over `resident`, the
    process's RSS once the model has loaded and run, before any case
    (runtime and weights), instead of the parameter bytes
    (`rss_bound_over_resident_mb`). `runtime_after_load_mb` is the runtime
    term R of docs/cache.md: `resident` less the weights.
    """
    mb = 1024 * 1024
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    longest = max(s.prompt_tokens + s.output_tokens for s in cold.steps)
    kv_longest = longest * engine.kv_bytes_per_token
    peak, before = min(rss)
    bound = (weights + 1.5 * kv_longest + budget) / mb
    tier_bound = (weights + 1.5 * kv_longest + memory_peak) / mb
    resident_bound = resident + (1.5 * kv_longest + memory_peak) / mb
    return {
        "peak_rss_mb": round(peak, 1),
        "peak_rss_mb_trials": [round(x, 1) for x, _ in rss],
        "rss_before_rebuild_mb": round(before, 1),
        "resident_rss_mb": round(resident, 1),
        "runtime_after_load_mb": round(resident - weights / mb, 1),
        "weights_mb": round(weights / mb, 1),
        "longest_sequence_tokens": longest,
        "kv_longest_mb": round(kv_longest / mb, 1),
        "memory_tier_peak_mb": round(memory_peak / mb, 1),
        "memory_tier_budget_mb": round(budget / mb, 1),
        "rss_bound_mb": round(bound, 1),
        "peak_rss_within_bound": peak <= bound,
        "rss_bound_tier_peak_mb": round(tier_bound, 1),
        "peak_rss_within_tier_peak_bound": peak <= tier_bound,
        "peak_rss_growth_mb": round(peak - before, 1),
        "peak_rss_over_resident_mb": round(peak - resident, 1),
        "rss_bound_over_resident_mb": round(resident_bound, 1),
        "peak_rss_within_bound_over_resident": peak <= resident_bound,
    }


def _wall(report: ReplayReport) -> float:
    return report.wall_s


def _figures(engine: Any, name: str, warm: ReplayReport, cold: ReplayReport,
             uncached: ReplayReport, verify: ReplayReport | None,
             verify_decode: ReplayReport | None, bound: tuple[float, int] | None,
             feed_bound_s: float) -> dict[str, Any]:
    from kvtrace.engine.generation import DraftVerdict

    total = cold.total
    prompts = [s.prompt_tokens for s in cold.steps]
    figures = {
        "model": engine.name,
        "run": name,
        "steps": total.steps,
        "tool_steps": cold.tool_steps,
        "max_prompt_tokens": max(prompts),
        "prompt_tokens": total.prompt_tokens,
        "reused_tokens": total.reused_tokens,
        "memory_tokens": total.memory_tokens,
        "disk_tokens": total.disk_tokens,
        "oracle_tokens": total.oracle_tokens,
        "hit_rate": _r(total.hit_rate),
        "oracle_hit_rate": _r(total.oracle_hit_rate),
        "hit_rate_equals_oracle": total.reused_tokens == total.oracle_tokens,
        "warm_hit_rate": _r(warm.total.hit_rate),
        "rebuild_s_cached": round(cold.wall_s, 3),
        "rebuild_s_uncached": round(uncached.wall_s, 3),
        "rebuild_speedup": round(uncached.wall_s / cold.wall_s, 2),
        "feed_lower_bound_s": round(feed_bound_s, 3),
        "rebuild_ratio_to_feed_bound": round(cold.wall_s / feed_bound_s, 3),
    }
    if verify is None or verify_decode is None or bound is None:
        return figures
    bound_s, bound_tokens = bound
    figures.update({
        "verify_s_cached": round(verify.wall_s, 3),
        "verify_matching_steps": verify.total.matching_steps,
        "verify_drafts_accepted": sum(s.draft is DraftVerdict.ACCEPTED for s in verify.steps),
        "verify_prefill_s": round(verify.total.prefill_s, 3),
        "verify_decode_s": round(verify.total.decode_s, 3),
        "verify_lower_bound_s": round(bound_s, 3),
        "verify_lower_bound_tokens": bound_tokens,
        "verify_ratio_to_lower_bound": round(verify.wall_s / bound_s, 3),
        "verify_decode_s_cached": round(verify_decode.wall_s, 3),
        "verify_decode_matching_steps": verify_decode.total.matching_steps,
        "verify_decode_ratio_to_lower_bound": round(verify_decode.wall_s / bound_s, 3),
        "verify_ratio_to_feed_bound": round(verify.wall_s / feed_bound_s, 3),
    })
    return figures


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
