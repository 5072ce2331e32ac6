"""`kvtrace bench scale`: a store of many agent runs; what one run's operations cost as it grows.

An evaluation harness records thousands of runs of tens to hundreds of
steps. This builds such a store through the public import path
(`import_document`, OpenAI format, as `kvtrace import --format openai`
records a trajectory): runs alternating between a tau-bench shape (10-50
model calls) and a SWE-agent shape (40-110 calls, command outputs up to a
few KB), about 100 steps a run, each with all its messages
(conversations.py). It grows in three sizes, each ten times the last
(10,000, 100,000 and 1,000,000 steps by default: 100 to 10,000 runs), in the
same store, and at each size times:

- the operations on one run: the first page of `runs`, the first page of
  `log` (and of `log --graph`), `show RUN@N`, resolving `RUN@2`, `fork`,
  `revert` (and the reset that undoes it, untimed), `diff` of a run and its
  edited fork, `export` of a run (bundle and OpenAI), and `analyze` of an
  `analyze_steps`-step run (tokenizer only);
- `import` of new tau-bench-shaped runs, in steps per second of wall time
  and per CPU second of this process (on a shared machine the wall clock
  also counts the time other processes held the cores);
- `fsck` of the whole store, in MB of content (blobs and step bodies) per
  second; and, for scale, listing every run.

The runs the operations touch (`probe`, its edited fork and the analyze run)
are imported first, so every size times the same runs. Each operation runs
`trials` times, each on a newly opened store (as a CLI command does: no
cache), and the median counts.

The sizes are timed minutes or hours apart, and on a shared machine the load
changes in between. So a *control* store, built the same way up to the
smallest size and then left alone (default: a second SQLite file; on another
backend `control_url`), is timed at every size too, its trials taking turns
with the growing store's: `over_control` is an operation's time over the
control's in the same minutes. `growth` is each figure at the largest size
over the smallest; `growth_vs_control` is `over_control` at the largest
size (the operation at 1,000,000 steps over the same operation at 10,000,
timed in the same minutes), and `control_check` the same at the smallest
size, where both stores hold the same runs: how far from 1 noise alone goes.
A single-run operation meets its target when `growth_vs_control` (`growth`
without a control) is at most GROWTH_TARGET (DESIGN.md: at 1,000,000 steps
every single-run operation costs at most 2x what it costs at 10,000).
"""

from __future__ import annotations

import io
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from kvtrace.bench.conversations import agent_document
from kvtrace.bench.footprint import body_bytes, store_file_bytes
from kvtrace.errors import UsageError
from kvtrace.store import StepKind, Store, open_store

GROWTH_TARGET = 2.0  # a single-run operation at the largest size over the smallest
IMPORT_TARGET = 2000.0  # steps per second, tau-bench-shaped trajectories, SQLite
MIN_STEPS = 1000
PROBE = "probe"
PROBE_EDITED = "probe-edited"
ANALYZED = "analyzed"
# The operations that touch one run (or one page): their growth has a target.
SINGLE_RUN = ("runs_page", "log_page", "log_graph_page", "show", "resolve", "fork", "revert",
              "diff", "export_bundle", "export_openai", "analyze")
_PROBE_CALLS = 50  # the probe run: a SWE-agent run of ~100 steps
_IMPORT_RUNS = 20  # tau-bench runs imported at each size to time the import


def _run_document(index: int) -> tuple[str, dict[str, Any]]:
    """The name and document of the `index`-th run of the store (deterministic)."""
    rng = random.Random(index)
    if index % 2 == 0:
        return f"tau-{index:06d}", agent_document(rng.randint(10, 50), seed=index, shape="tau")
    return f"swe-{index:06d}", agent_document(rng.randint(40, 110), seed=index, shape="swe")


def steps_of(document: dict[str, Any]) -> int:
    """The steps an OpenAI document imports as: its assistant messages and answered results."""
    calls: set[str] = set()
    count = 0
    for message in document["messages"]:
        if message["role"] == "assistant":
            count += 1
            calls.update(call["id"] for call in message.get("tool_calls") or [])
        elif message["role"] == "tool" and message.get("tool_call_id") in calls:
            count += 1
    return count


def _document_of_steps(num_steps: int, seed: int) -> dict[str, Any]:
    """A tau-bench-shaped document that imports as exactly `num_steps` steps."""
    document = agent_document(num_steps // 2 + 2, seed=seed, shape="tau")
    messages: list[dict[str, Any]] = []
    for message in document["messages"]:
        messages.append(message)
        if steps_of({"messages": messages}) >= num_steps:  # a few hundred calls: cheap enough
            break
    return {**document, "messages": messages}


def run_scale_bench(
    url: str | None = None,
    *,
    num_steps: int = 1_000_000,
    analyze_steps: int = 1000,
    model: str | None = None,
    trials: int = 15,
    control_url: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build a store of `num_steps` steps on `url` (an empty store; default: a new SQLite
    file in a temp folder) in three sizes and time every operation at each, against a
    control store left at the smallest size (`control_url`, an empty store; default
    with the default `url`: another new SQLite file; else no control)."""
    if num_steps < MIN_STEPS:
        raise UsageError(f"steps must be at least {MIN_STEPS}", param="steps")
    if analyze_steps < 0 or trials < 1:
        raise UsageError("analyze_steps must be >= 0 and trials >= 1")
    say = progress or (lambda _text: None)
    with tempfile.TemporaryDirectory(prefix="kvtrace-scale-") as tmp:
        store = _empty_store(url or f"sqlite:///{Path(tmp) / 'scale.db'}", "url")
        control = None
        try:
            if control_url or url is None:
                control = _empty_store(control_url or f"sqlite:///{Path(tmp) / 'control.db'}",
                                       "control_url")
            return _bench(store, control, num_steps, analyze_steps, model, trials, say)
        finally:
            store.close()
            if control is not None:
                control.close()


def _empty_store(url: str, param: str) -> Store:
    store = open_store(url)
    if store.runs(limit=1):
        store.close()
        raise UsageError("the scale benchmark needs an empty store: give a new database "
                         "(PostgreSQL: a new schema)", param=param)
    return store


def _grow(store: Store, size: int, built: int, index: int,
          say: Callable[[str], None]) -> tuple[int, int]:
    """Import the store's next runs until it holds `size` steps; (steps, runs imported)."""
    from kvtrace.formats import import_document

    while built < size:
        name, document = _run_document(index)
        built += import_document(store, document, format="openai", run=name).depth
        index += 1
        if index % 500 == 0:
            say(f"built {built:,} steps ({index:,} runs)")
    return built, index


def _bench(store: Store, control: Store | None, num_steps: int, analyze_steps: int,
           model: str | None, trials: int, say: Callable[[str], None]) -> dict[str, Any]:
    sizes = [num_steps // 100, num_steps // 10, num_steps]
    tokenizer = _tokenizer(model) if analyze_steps else None
    if control is not None:  # the same runs up to the smallest size, then left alone
        _make_probes(control, analyze_steps)
        _grow(control, sizes[0], _count_steps(control), 0, say)
    _make_probes(store, analyze_steps)
    built, index, build_s = _count_steps(store), 0, 0.0
    at_size: list[dict[str, Any]] = []
    for size in sizes:
        start, first = time.perf_counter(), built
        built, index = _grow(store, size, built, index, say)
        build_s += time.perf_counter() - start
        say(f"at {built:,} steps ({index:,} runs): timing")
        figures = _time_operations(store, control, trials, tokenizer, label=str(size))
        figures["build_steps_per_s"] = round((built - first) / max(
            time.perf_counter() - start, 1e-9), 1) if built > first else None
        imported = figures["import"]["num_steps"]
        built += imported
        figures.update(num_steps=built, num_runs=len(store.runs()),
                       file_bytes=store_file_bytes(store), load_avg_1m=round(os.getloadavg()[0], 2),
                       utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
        at_size.append(figures)
        say(f"at {built:,} steps: " + ", ".join(
            f"{name} {figures['ms'][name]} ms" for name in SINGLE_RUN if name in figures["ms"]))
    return _report(store, sizes, at_size, analyze_steps, build_s)


def _report(store: Store, sizes: list[int], at_size: list[dict[str, Any]], analyze_steps: int,
            build_s: float) -> dict[str, Any]:
    first, last = at_size[0], at_size[-1]
    growth = {name: round(last["ms"][name] / first["ms"][name], 3)
              for name in first["ms"] if first["ms"][name]}
    growth["import_steps_per_s"] = round(
        last["import"]["steps_per_s"] / first["import"]["steps_per_s"], 3)
    growth["import_steps_per_cpu_s"] = round(
        last["import"]["steps_per_cpu_s"] / first["import"]["steps_per_cpu_s"], 3)
    growth["fsck_mb_per_s"] = round(last["fsck"]["mb_per_s"] / first["fsck"]["mb_per_s"], 3)
    vs_control = dict(last.get("over_control", {}))
    is_sqlite = store.engine.dialect.name == "sqlite"
    judged = vs_control or growth
    single = {name: judged[name] for name in SINGLE_RUN if name in judged}
    return {
        "backend": store.engine.dialect.name,
        "sizes": sizes,
        "analyze_steps": analyze_steps,
        "build_s": round(build_s, 1),
        "at": {str(figures["num_steps"]): figures for figures in at_size},
        "growth": growth,
        "growth_vs_control": vs_control or None,
        "control_check": first.get("over_control"),
        "worst_single_run_growth": max(single.values()) if single else None,
        "targets": {"single_run_growth": GROWTH_TARGET,
                    "import_steps_per_s": IMPORT_TARGET if is_sqlite else None},
        "targets_met": all(value <= GROWTH_TARGET for value in single.values()) and (
            not is_sqlite or min(f["import"]["steps_per_s"] for f in at_size) >= IMPORT_TARGET),
        # The import target counted per CPU second: what an idle machine would give.
        "import_target_met_per_cpu_s": not is_sqlite or min(
            f["import"]["steps_per_cpu_s"] for f in at_size) >= IMPORT_TARGET,
    }


def _make_probes(store: Store, analyze_steps: int) -> None:
    """The runs every size times: a SWE-agent run, a fork of it with one tool result edited
    halfway (then two more steps), and the run `analyze` reads."""
    from kvtrace.formats import import_document

    document = agent_document(_PROBE_CALLS, seed=-1, shape="swe")
    import_document(store, document, format="openai", run=PROBE)
    middle = _middle_tool_call(store)
    fork = store.fork(middle, PROBE_EDITED, edit={"result": "<returncode>1</returncode>"})
    fork.record_model_call([{"role": "user", "content": "the command failed; try again"}],
                           {"role": "assistant", "content": "THOUGHT: retrying"}, model="m")
    fork.record_tool_call("bash", {"command": "true"}, "<returncode>0</returncode>")
    if analyze_steps:
        import_document(store, _document_of_steps(analyze_steps, seed=-2), format="openai",
                        run=ANALYZED)


def _middle_tool_call(store: Store) -> str:
    depth = store.run_info(PROBE).depth
    for step in store.log(f"{PROBE}@{depth // 2 + 1}", limit=2):
        if step.kind == StepKind.TOOL_CALL:
            return step.id
    raise UsageError("the probe run has no tool call halfway")


def _count_steps(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT COUNT(*) FROM steps")).scalar_one())


def _tokenizer(model: str | None) -> Any:
    from kvtrace.engine import load_tokenizer
    from kvtrace.paths import default_cache_dir

    return load_tokenizer(model, cache_dir=default_cache_dir())


def _time_operations(store: Store, control: Store | None, trials: int, tokenizer: Any, *,
                     label: str) -> dict[str, Any]:
    """Median ms of each operation over `trials` newly opened stores (taking turns with the
    control's, when there is one), then import and fsck."""
    ms = _median_ms(store, control, trials, tokenizer, label)
    figures: dict[str, Any] = {"ms": ms[0]}
    if control is not None:
        figures["control_ms"] = ms[1]
        figures["over_control"] = {name: round(ms[0][name] / ms[1][name], 3)
                                   for name in ms[0] if ms[1].get(name)}
    figures["import"] = _time_import(store, label)
    figures["fsck"] = _time_fsck(store)
    return figures


def _median_ms(store: Store, control: Store | None, trials: int, tokenizer: Any,
               label: str) -> list[dict[str, float]]:
    """[store's medians, control's medians ({} without one)]: the two take turns, each trial
    starting with the other, so that machine noise hits both alike."""
    from kvtrace.replay import analyze

    targets = [store] if control is None else [store, control]
    samples: list[dict[str, list[float]]] = [{} for _ in targets]
    operations = [_operations(target, label) for target in targets]
    for trial in range(trials):
        for name in operations[0]:
            order = list(range(len(targets)))
            for which in order if trial % 2 == 0 else order[::-1]:
                samples[which].setdefault(name, []).append(
                    _time_fresh(targets[which], operations[which][name], name))
    medians = [{name: round(statistics.median(values), 3) for name, values in found.items()}
               for found in samples]
    if tokenizer is not None:
        for which, target in enumerate(targets):
            medians[which]["analyze"] = _time_fresh(
                target, lambda s: analyze(s, ANALYZED, tokenizer), "analyze")
    return medians if control is not None else [medians[0], {}]


def _time_fresh(store: Store, operation: Callable[[Store], Any], name: str) -> float:
    """ms of `operation` on a newly opened store (a revert is undone after, untimed)."""
    head = store.resolve(PROBE) if name == "revert" else None
    reader = open_store(store.url)
    try:
        begin = time.perf_counter()
        operation(reader)
        elapsed = (time.perf_counter() - begin) * 1000
        if name == "revert":
            reader.reset(PROBE, to=head)
        return round(elapsed, 3)
    finally:
        reader.close()


def _operations(store: Store, label: str) -> dict[str, Callable[[Store], Any]]:
    """The timed operations on `store`'s probe runs, by name."""
    from kvtrace.formats import export_document
    from kvtrace.store.present.compare import compare

    depth = store.run_info(PROBE).depth
    counter = iter(range(1_000_000))
    operations: dict[str, Callable[[Store], Any]] = {
        "runs_page": lambda s: s.runs(limit=50),
        "log_page": lambda s: list(s.log(PROBE, limit=20)),
        "log_graph_page": lambda s: s.graph(PROBE, limit=20),
        "show": lambda s: s.show(f"{PROBE}@{depth // 2}"),
        "resolve": lambda s: s.resolve(f"{PROBE}@2"),
        "fork": lambda s: s.fork(f"{PROBE}@2", f"fork-{label}-{next(counter)}"),
        "revert": lambda s: s.revert(PROBE, to=f"{PROBE}@2"),
        "diff": lambda s: compare(s, PROBE, PROBE_EDITED),
        "export_bundle": lambda s: s.export_run(PROBE, io.BytesIO()),
        "export_openai": lambda s: export_document(s, PROBE, format="openai"),
        "runs_all": lambda s: s.runs(),
    }
    return operations


def _time_import(store: Store, label: str) -> dict[str, Any]:
    """Steps per second importing `_IMPORT_RUNS` new tau-bench-shaped runs (documents made
    before the clock starts)."""
    from kvtrace.formats import import_document

    rng = random.Random(label)
    documents = [agent_document(rng.randint(10, 50), seed=rng.randrange(10**9), shape="tau")
                 for _ in range(_IMPORT_RUNS)]
    begin, cpu = time.perf_counter(), time.process_time()
    num_steps = sum(import_document(store, document, format="openai",
                                    run=f"import-{label}-{i}").depth
                    for i, document in enumerate(documents))
    seconds, cpu_seconds = time.perf_counter() - begin, time.process_time() - cpu
    # Per CPU second of this process too: on a shared machine the wall clock
    # also counts the time other processes held the cores.
    return {"num_runs": len(documents), "num_steps": num_steps,
            "steps_per_s": round(num_steps / seconds, 1),
            "steps_per_cpu_s": round(num_steps / max(cpu_seconds, 1e-9), 1)}


def _time_fsck(store: Store) -> dict[str, Any]:
    """fsck of the whole store: MB of content (blob content and step bodies) per second."""
    with store.engine.connect() as conn:  # step bodies as fsck re-hashes them: unpacked
        content = int(conn.execute(sa.text("SELECT COALESCE(SUM(size), 0) FROM blobs"))
                      .scalar_one()) + body_bytes(conn)[0]
    reader = open_store(store.url)
    try:
        begin = time.perf_counter()
        report = reader.fsck()
        seconds = time.perf_counter() - begin
    finally:
        reader.close()
    return {"content_mb": round(content / 1e6, 1), "s": round(seconds, 2),
            "mb_per_s": round(content / 1e6 / seconds, 1), "is_ok": report.is_ok}
