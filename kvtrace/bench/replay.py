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
   accepted drafts (`rebuild_ratio_to_feed_bound`, `verify_ratio_to_feed_bound`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtrace.replay import SamplingParams, replay
from kvtrace.replay.local import LocalBackend
from kvtrace.replay.oracle import common_prefix_length
from kvtrace.replay.recording import expected_output_ids, step_messages
from kvtrace.replay.report import ReplayReport
from kvtrace.replay.tools import CITY_FACTS, ask_demo_agent
from kvtrace.store import Store, open_store

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
    prefix it shares with it and computes the rest in one forward. With
    `decode`, the output is then fed one token per forward, as decoding does
    (the last token's forward is not counted: generation never runs it);
    without, it goes in the same forward as the prompt, as rebuild feeds it
    (the floor for rebuild and for verify with accepted drafts).
    """
    import torch
    from transformers import DynamicCache

    model, device = engine.model, engine.device
    kv = DynamicCache(config=model.config)

    def forward(ids: list[int]) -> None:
        model(input_ids=torch.tensor([ids], device=device), cache=kv, use_cache=True,
              logits_to_keep=1)

    live: list[int] = []
    seconds, computed = 0.0, 0
    with torch.inference_mode():
        for step in store.path(spec):
            if step.kind != "model_call":
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


def run_replay_bench(*, cache_dir: Path, model: str | None = None, fresh: bool = False,
                     trials: int = 2) -> dict[str, Any]:
    """Record (once) and replay a long agent run; one dict of measurements.

    Every timed case runs `trials` times, the cases interleaved, and the
    fastest trial counts: on a shared 2-core machine another process can slow
    one trial several-fold, never speed one up.
    """
    from kvtrace.engine import KVCache, load_engine

    engine = load_engine(model, cache_dir=cache_dir)
    root = cache_dir / "bench" / "replay"
    if fresh and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    store = open_store(f"sqlite:///{root / 'store.db'}")
    name = f"session-{RECIPE}-{engine.fingerprint[:12]}"
    load_before = os.getloadavg()[0]
    cases: dict[str, list[Any]] = {
        "cold": [], "uncached": [], "verify": [], "verify_decode": [], "bound": [],
        "feed_bound": [],
    }
    try:
        recorded_now = name not in {r.name for r in store.runs()}
        recorder = LocalBackend(engine, KVCache(engine, disk_dir=root / "kv-recording"))
        record_s = 0.0
        if recorded_now:
            started = time.perf_counter()
            record_session(store, name, recorder)
            record_s = time.perf_counter() - started
        warm = replay(store, name, recorder, mode="rebuild")
        for _ in range(max(1, trials)):
            with tempfile.TemporaryDirectory(prefix="kvtrace-bench-") as tmp:
                cases["cold"].append(replay(store, name, LocalBackend(engine, KVCache(
                    engine, disk_dir=Path(tmp) / "rebuild")), mode="rebuild"))
                cases["uncached"].append(
                    replay(store, name, LocalBackend(engine, None), mode="rebuild"))
                cases["verify"].append(replay(store, name, LocalBackend(engine, KVCache(
                    engine, disk_dir=Path(tmp) / "verify")), mode="verify"))
                decoding = LocalBackend(engine, KVCache(engine, disk_dir=Path(tmp) / "decode"))
                cases["verify_decode"].append(
                    replay(store, name, decoding, mode="verify", use_drafts=False))
            cases["bound"].append(lower_bound_seconds(store, name, engine))
            cases["feed_bound"].append(lower_bound_seconds(store, name, engine, decode=False))
    finally:
        store.close()
    bound_s, bound_tokens = min(cases["bound"])
    figures = _figures(
        engine, name, recorded_now, record_s, warm,
        min(cases["cold"], key=_wall), min(cases["uncached"], key=_wall),
        min(cases["verify"], key=_wall), min(cases["verify_decode"], key=_wall),
        bound_s, bound_tokens, min(cases["feed_bound"])[0],
    )
    figures["trials"] = len(cases["cold"])
    for case, key in (("cold", "rebuild_s_cached"), ("uncached", "rebuild_s_uncached"),
                      ("verify", "verify_s_cached"), ("verify_decode", "verify_decode_s_cached")):
        figures[f"{key}_trials"] = [round(r.wall_s, 3) for r in cases[case]]
    figures["verify_lower_bound_s_trials"] = [round(b[0], 3) for b in cases["bound"]]
    figures["feed_lower_bound_s_trials"] = [round(b[0], 3) for b in cases["feed_bound"]]
    figures["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return figures


def _wall(report: ReplayReport) -> float:
    return report.wall_s


def _figures(engine: Any, name: str, recorded_now: bool, record_s: float,
             warm: ReplayReport, cold: ReplayReport, uncached: ReplayReport,
             verify: ReplayReport, verify_decode: ReplayReport, bound_s: float,
             bound_tokens: int, feed_bound_s: float) -> dict[str, Any]:
    total = cold.total
    prompts = [s.prompt_tokens for s in cold.steps]
    return {
        "model": engine.name,
        "run": name,
        "recorded_now": recorded_now,
        "record_s": round(record_s, 3),
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
        "warm_source": "memory+disk (just recorded)" if recorded_now
        else "disk tier left by an earlier recording",
        "rebuild_s_cached": round(cold.wall_s, 3),
        "rebuild_s_uncached": round(uncached.wall_s, 3),
        "rebuild_speedup": round(uncached.wall_s / cold.wall_s, 2),
        "verify_s_cached": round(verify.wall_s, 3),
        "verify_matching_steps": verify.total.matching_steps,
        "verify_drafts_accepted": sum(s.draft == "accepted" for s in verify.steps),
        "verify_prefill_s": round(verify.total.prefill_s, 3),
        "verify_decode_s": round(verify.total.decode_s, 3),
        "verify_lower_bound_s": round(bound_s, 3),
        "verify_lower_bound_tokens": bound_tokens,
        "verify_ratio_to_lower_bound": round(verify.wall_s / bound_s, 3),
        "verify_decode_s_cached": round(verify_decode.wall_s, 3),
        "verify_decode_matching_steps": verify_decode.total.matching_steps,
        "verify_decode_ratio_to_lower_bound": round(verify_decode.wall_s / bound_s, 3),
        "feed_lower_bound_s": round(feed_bound_s, 3),
        "rebuild_ratio_to_feed_bound": round(cold.wall_s / feed_bound_s, 3),
        "verify_ratio_to_feed_bound": round(verify.wall_s / feed_bound_s, 3),
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
