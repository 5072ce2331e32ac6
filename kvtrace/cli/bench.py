"""`kvtrace bench ...`: benchmarks, printing their figures as text or, with `--json`, as one
JSON object (what scripts/run_all.sh keeps and docs/benchmarks.md quotes).

Benchmarks are measurements, never timed tests: each runs the compared cases
side by side in one process and reports medians and ratios. The logic lives in
`kvtrace.bench`; heavy imports happen inside each command.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvtrace.cli.app import Json, Model, Precision, bench_app, print_json, store_url
from kvtrace.errors import UsageError


def _print_figures(figures: dict[str, Any], as_json: bool) -> None:
    """The one JSON object, or one `name  value` line per figure (nested names dotted)."""
    if as_json:
        print_json(figures)
        return
    rows = list(_flat(figures))
    width = max((len(name) for name, _ in rows), default=0)
    for name, value in rows:
        typer.echo(f"{name:<{width}}  {value}")


def _flat(value: Any, prefix: str = "") -> Any:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        for index, item in enumerate(value):
            yield from _flat(item, f"{prefix}[{index}]")
    elif isinstance(value, list):
        yield prefix, ", ".join(str(item) for item in value)
    else:
        yield prefix, value


@bench_app.command("store")
def bench_store(
    url: Annotated[str | None, typer.Option(
        "--url", help="Store URL to measure (default: a temp SQLite file).")] = None,
    num_appends: Annotated[int, typer.Option(
        "--appends", help="Number of appends to time.")] = 2000,
    as_json: Json = False,
) -> None:
    """Append latency, and fork/revert time at 10 vs 10,000 steps."""
    from kvtrace.bench.store import run_store_bench

    _print_figures(run_store_bench(url, num_appends=num_appends), as_json)


@bench_app.command("workspace")
def bench_workspace(
    num_files: Annotated[int, typer.Option("--files", help="Files in the folder.")] = 1000,
    total_mb: Annotated[float, typer.Option("--mb", help="Their size in all, MB.")] = 50.0,
    num_changed: Annotated[int, typer.Option(
        "--changed", help="Files rewritten between two snapshots.")] = 3,
    rounds: Annotated[int, typer.Option("--rounds", help="Snapshots timed.")] = 30,
    no_watch: Annotated[bool, typer.Option(
        "--no-watch", help="Walk the folder at every snapshot (no inotify events).")] = False,
    as_json: Json = False,
) -> None:
    """What `record --workspace` costs per model call: a snapshot where few files changed,
    and the store's growth over the bytes that changed."""
    from kvtrace.bench.workspace import run_workspace_bench

    if min(num_files, num_changed, rounds) < 1 or num_changed * rounds > num_files:
        raise UsageError("--files, --changed and --rounds must be >= 1, and --changed x "
                         "--rounds at most --files (each round rewrites files not yet rewritten)")
    if not total_mb > 0:
        raise UsageError(f"--mb {total_mb:g}: give a size > 0")
    _print_figures(run_workspace_bench(num_files=num_files, total_mb=total_mb,
                                       num_changed=num_changed, rounds=rounds,
                                       watch=not no_watch), as_json)


@bench_app.command("appends")
def bench_appends(
    urls: Annotated[list[str] | None, typer.Argument(
        help="Store URLs to compare, e.g. sqlite:///a.db?synchronous=full or "
        "postgresql://...?options=-csynchronous_commit%3Doff (default: two temp SQLite "
        "files, synchronous=normal and synchronous=full).")] = None,
    num_appends: Annotated[int, typer.Option(
        "--appends", help="Appends to time per store.")] = 1000,
    as_json: Json = False,
) -> None:
    """Append latency of several stores side by side, taking turns."""
    from kvtrace.bench.store import run_append_comparison

    _print_figures(run_append_comparison(urls or None, num_appends=num_appends), as_json)


@bench_app.command("replay")
def bench_replay(
    ctx: typer.Context,
    model: Model = None,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Record the benchmark run again instead of reusing it.")] = False,
    trials: Annotated[int, typer.Option(
        "--trials", help="Runs per timed case (the fastest counts).")] = 2,
    shape: Annotated[str, typer.Option(
        "--shape",
        help="Fixture: session (14-call ReAct session) or agent (30 calls, 1.6k to 5k+ "
        "tokens).")] = "session",
    run: Annotated[str | None, typer.Option(
        "--run", help="Measure this run of the store (--store) instead of a fixture.")] = None,
    calls: Annotated[int | None, typer.Option(
        "--calls", min=1,
        help="Model calls of the agent fixture (default 30; fewer is faster).")] = None,
    no_verify: Annotated[bool, typer.Option(
        "--no-verify", help="Skip the verify cases and their decoding bound.")] = False,
    dtype: Annotated[Precision, typer.Option(
        "--dtype", help="The engine's number format (and --peer vllm's); auto: bfloat16 "
        "where the CPU computes it natively, else float32.")
    ] = Precision.AUTO,
    peer: Annotated[str | None, typer.Option(
        "--peer", help="Also rebuild through this OpenAI-compatible server (base URL with its "
        "API prefix), cold, the tokens checked through its /tokenize; 'vllm': vLLM's CPU "
        "build from `make bench-peers`, started here.")] = None,
    peer_model: Annotated[str | None, typer.Option(
        "--peer-model", help="The model name sent to --peer (default: the recorded one).")
    ] = None,
    peer_block_size: Annotated[int | None, typer.Option(
        "--peer-block-size", min=1, help="With --peer vllm: its KV block size in tokens "
        "(default: its CPU build's, 128).")] = None,
    as_json: Json = False,
) -> None:
    """Replay an agent run every way: hit rate vs oracle, speed-up, bounds, peak RSS; with
    --peer, the same rebuild through another server."""
    from kvtrace.bench.replay import run_replay_bench
    from kvtrace.paths import default_cache_dir

    if peer_block_size is not None and peer != "vllm":
        raise typer.BadParameter("only with --peer vllm", param_hint="--peer-block-size")
    _print_figures(
        run_replay_bench(cache_dir=default_cache_dir(), model=model, fresh=fresh, trials=trials,
                         shape=shape, run=run, store_url=store_url(ctx), calls=calls,
                         with_verify=not no_verify, dtype=dtype.value, peer=peer,
                         peer_model=peer_model, peer_block_size=peer_block_size),
        as_json,
    )


@bench_app.command("cache")
def bench_cache(
    model: Model = None,
    num_tokens: Annotated[int, typer.Option(
        "--tokens", help="Prompt length of the cold prefill.")] = 2048,
    num_new: Annotated[int, typer.Option(
        "--new", help="New tokens after the cached prefix.")] = 32,
    repeats: Annotated[int, typer.Option(
        "--repeats", help="Runs per case (the median is reported).")] = 3,
    family: Annotated[str | None, typer.Option(
        "--family", help="A tiny random model of this family instead of --model (gemma3, "
        "gpt_oss, mistral, jamba, bamba, falcon_h1, granite_moe_hybrid, qwen3_next, lfm2, "
        "mamba2, mamba, rwkv, qwen3_moe, olmoe).")] = None,
    as_json: Json = False,
) -> None:
    """Prefill: cold vs prefix from memory vs from disk, cache bytes per token or per kind."""
    from kvtrace.bench.cache import run_cache_bench
    from kvtrace.paths import default_cache_dir

    if family is not None and model is not None:
        raise UsageError("--family builds its own model: give --family or --model, not both")
    _print_figures(
        run_cache_bench(
            cache_dir=default_cache_dir(),
            model=model,
            num_tokens=num_tokens,
            num_new=num_new,
            repeats=repeats,
            family=family,
        ),
        as_json,
    )


@bench_app.command("decode")
def bench_decode(
    model: Model = None,
    num_tokens: Annotated[int, typer.Option(
        "--tokens", min=1, help="Prompt length before decoding.")] = 2048,
    num_new: Annotated[int, typer.Option(
        "--new", min=2, help="Tokens decoded per generation.")] = 64,
    batch: Annotated[int, typer.Option(
        "--batch", min=1, max=16, help="Sequences decoded together in the batched case "
        "(up to 16: one forward of the batcher's default).")] = 4,
    trials: Annotated[int, typer.Option(
        "--trials", min=1, help="Runs per case (the fastest counts).")] = 2,
    dtype: Annotated[Precision, typer.Option(
        "--dtype", help="The engine's number format; auto: bfloat16 where the CPU computes "
        "it natively, else float32.")] = Precision.AUTO,
    as_json: Json = False,
) -> None:
    """A decode step alone and batched, beside its bound (the weights read once)."""
    from kvtrace.bench.decode import run_decode_bench
    from kvtrace.paths import default_cache_dir

    _print_figures(
        run_decode_bench(cache_dir=default_cache_dir(), model=model, dtype=dtype.value,
                         num_tokens=num_tokens, num_new=num_new, batch=batch, trials=trials),
        as_json,
    )


@bench_app.command("serve")
def bench_serve(
    model: Model = None,
    num_requests: Annotated[int, typer.Option(
        "--requests", help="Chat requests extending one conversation (local mode).")] = 20,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", help="Tokens generated per request.")] = 16,
    num_rounds: Annotated[int, typer.Option(
        "--rounds",
        help="Times the conversation is sent through --upstream, recording and not.")] = 10,
    as_json: Json = False,
) -> None:
    """Latency and cached-token fraction through kvtrace serve, and recording's overhead."""
    from kvtrace.bench.serve import run_serve_bench
    from kvtrace.paths import default_cache_dir

    if num_requests < 1 or max_tokens < 1 or num_rounds < 1:
        raise UsageError("--requests, --max-tokens and --rounds must be >= 1")
    _print_figures(run_serve_bench(cache_dir=default_cache_dir(), model=model,
                                   num_requests=num_requests, max_tokens=max_tokens,
                                   num_rounds=num_rounds), as_json)


@bench_app.command("fork")
def bench_fork(
    model: Model = None,
    calls: Annotated[int, typer.Option("--calls", min=2, help="Model calls of the agent.")] = 10,
    k: Annotated[int, typer.Option(
        "--k", min=1, help="Answer calls 1..K from the recording (--from base@K).")] = 6,
    trials: Annotated[int, typer.Option(
        "--trials", min=1, help="Runs per case, alternating (the fastest counts).")] = 2,
    n: Annotated[int | None, typer.Option(
        "--n", min=1,
        help="Instead: N agent processes (record --from base@K --n N) and N branches (branch "
        "--n N) decoded together, against the same N one after another: tokens per second.")
    ] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", min=1, help="With --n: tokens per answer (the agents' max_tokens, the "
        "branches' max_new_tokens; default 96); with --processes, the agent's (default 24).")
    ] = None,
    processes: Annotated[bool, typer.Option(
        "--processes", help="Instead: whole `kvtrace record` processes, start included: the "
        "agent re-run against `record --from base@K`, and how much of what its first K calls "
        "cost the fork saved.")] = False,
    tool_seconds: Annotated[float | None, typer.Option(
        "--tool-seconds", min=0, help="With --processes: seconds each of the agent's tool "
        "calls takes (real agents run tests, read files; default 0.5).")] = None,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="With --n: sampling temperature (agent i, branch i: seed i-1).")
    ] = 0.8,
    steps: Annotated[int, typer.Option(
        "--steps", min=1, help="With --n: model calls per branch.")] = 2,
    case: Annotated[str, typer.Option(
        "--case", help="With --n: 'agents', 'branch' or 'both'.")] = "both",
    peer: Annotated[str | None, typer.Option(
        "--peer", help="Instead: replay the run and forks of it taken at --fork-steps, "
        "interleaved, through kvtrace serve and through this OpenAI-compatible server "
        "(base URL with its API prefix, e.g. http://127.0.0.1:8080/v1), both cold; 'vllm': "
        "vLLM's CPU build from `make bench-peers`, started here.")] = None,
    peer_model: Annotated[str | None, typer.Option(
        "--peer-model", help="The model name sent to --peer (default: the recorded one).")
    ] = None,
    fork_steps: Annotated[str, typer.Option(
        "--fork-steps", help="With --peer: the steps the forks are taken at, "
        "comma-separated.")] = "2,4,6,8",
    dtype: Annotated[Precision, typer.Option(
        "--dtype", help="With --peer: the number format of the kvtrace serve timed (the "
        "workload is recorded in float32 either way), and of --peer vllm; auto: bfloat16 "
        "where the CPU computes it natively, else float32; with --processes, the engine's.")
    ] = Precision.AUTO,
    peer_block_size: Annotated[int | None, typer.Option(
        "--peer-block-size", min=1, help="With --peer vllm: its KV block size in tokens "
        "(default: its CPU build's, 128).")] = None,
    contend: Annotated[int, typer.Option(
        "--contend", min=0, help="With --peer: N processes keeping a core busy each, "
        "alongside both sides' timed replays.")] = 0,
    as_json: Json = False,
) -> None:
    """An agent forked at step K (--from) against re-running it whole, on the local engine;
    with --n, K experiments at once against one after another; with --peer, a run and its
    forks replayed through kvtrace and through another server; with --processes, whole
    `kvtrace record` processes, start included."""
    if tool_seconds is not None and not processes:
        raise typer.BadParameter("only with --processes", param_hint="--tool-seconds")
    if processes and peer is not None:
        raise typer.BadParameter("--processes times kvtrace record alone: not with --peer",
                                 param_hint="--processes")
    if peer is not None:
        from kvtrace.bench.peer import run_peer_bench

        try:
            fork_at = tuple(int(part) for part in fork_steps.split(","))
        except ValueError:
            raise typer.BadParameter(f"{fork_steps!r} is not a comma-separated list of steps",
                                     param_hint="--fork-steps") from None
        if not fork_at or any(not 1 <= step < calls for step in fork_at):
            raise typer.BadParameter(f"fork steps must be in 1..{calls - 1}",
                                     param_hint="--fork-steps")
        if peer_block_size is not None and peer != "vllm":
            raise typer.BadParameter("only with --peer vllm", param_hint="--peer-block-size")
        _print_figures(run_peer_bench(peer, model=model, peer_model=peer_model, calls=calls,
                                      fork_steps=fork_at, trials=trials, dtype=dtype.value,
                                      peer_block_size=peer_block_size, contend=contend),
                       as_json)
        return
    if contend:
        raise typer.BadParameter("only with --peer", param_hint="--contend")
    if processes and n is not None:
        raise typer.BadParameter("--processes times one agent: not with --n",
                                 param_hint="--processes")
    if k >= calls:
        raise typer.BadParameter(f"--k must be below --calls ({calls})", param_hint="--k")
    if case not in ("agents", "branch", "both"):
        raise typer.BadParameter(f"{case!r}: 'agents', 'branch' or 'both'", param_hint="--case")
    if n is not None:
        from kvtrace.bench.experiments import CASES, run_experiments_bench

        _print_figures(run_experiments_bench(
            model=model, n=n, calls=calls, k=k, max_tokens=max_tokens or 96,
            temperature=temperature,
            steps=steps, trials=trials, cases=CASES if case == "both" else (case,)), as_json)
        return
    if processes:
        from kvtrace.bench.forkstart import run_fork_start_bench

        _print_figures(run_fork_start_bench(
            model=model, calls=calls, k=k, max_tokens=max_tokens or 24,
            tool_seconds=0.5 if tool_seconds is None else tool_seconds, trials=trials,
            dtype=dtype.value), as_json)
        return
    from kvtrace.bench.fork import run_fork_bench

    _print_figures(run_fork_bench(model=model, calls=calls, k=k, trials=trials), as_json)


@bench_app.command("multireplay")
def bench_multireplay(
    server: Annotated[str, typer.Option(
        "--server",
        help="serve: kvtrace serve on the local model, in its own process; llama-cpp: "
        "llama-cpp-python's server (.venv-llama, make test-integration; one request at a time); "
        "vllm: vLLM's CPU build (.venv-vllm, make bench-peers; reset before each case); "
        "slots: a stand-in that answers after --latency-ms, --slots at a time (no model); "
        "or the URL of a running server.")] = "serve",
    num_runs: Annotated[int, typer.Option("--runs", min=1, help="Runs in the set.")] = 8,
    calls: Annotated[int, typer.Option(
        "--calls", min=1, help="Model calls per run.")] = 6,
    concurrency: Annotated[str, typer.Option(
        "--concurrency", help="Comma-separated concurrencies to compare, e.g. 1,4.")] = "1,4",
    mode: Annotated[str, typer.Option(
        "--mode", help="rebuild (prompts only) or verify (responses decoded too).")] = "rebuild",
    trials: Annotated[int, typer.Option(
        "--trials", min=1, help="Rounds of the cases, alternating (the fastest counts).")] = 1,
    slots: Annotated[int, typer.Option(
        "--slots", min=1, help="Parallel slots of the stand-in.")] = 4,
    latency_ms: Annotated[float, typer.Option(
        "--latency-ms", min=0, help="The stand-in's time per request.")] = 200.0,
    llama_python: Annotated[str | None, typer.Option(
        "--llama-python",
        help="Python of a llama-cpp-python[server] install (default .venv-llama/bin/python).")]
    = None,
    model: Model = None,
    as_json: Json = False,
) -> None:
    """Many runs replayed with several requests in flight (replay_runs) vs one at a time."""
    from pathlib import Path

    from kvtrace.bench.multireplay import SERVERS, run_multireplay_bench
    from kvtrace.paths import default_cache_dir
    from kvtrace.replay.driver import replay_mode

    try:
        levels = tuple(int(part) for part in concurrency.split(","))
    except ValueError:
        raise UsageError(f"--concurrency {concurrency!r}: whole numbers, comma-separated") \
            from None
    if not levels or min(levels) < 1:
        raise UsageError("--concurrency: each level must be >= 1")
    if server not in SERVERS and not server.startswith(("http://", "https://")):
        raise UsageError(f"--server {server!r}: one of {', '.join(SERVERS)}, or a URL")
    _print_figures(run_multireplay_bench(
        cache_dir=default_cache_dir(), server=server, num_runs=num_runs, num_calls=calls,
        concurrency=levels, mode=replay_mode(mode), trials=trials, model=model, slots=slots,
        latency_ms=latency_ms, llama_python=Path(llama_python) if llama_python else None),
        as_json)


@bench_app.command("long")
def bench_long(
    turns: Annotated[list[int] | None, typer.Option(
        "--turns", min=1, help="Conversation sizes in turns (model calls); give two or more "
        "(default: 1000 and 10000).")] = None,
    trees: Annotated[list[str] | None, typer.Option(
        "--tree", help="A source tree (a folder holding a kvtrace package, e.g. a worktree of "
        "another commit) whose CLI to time; repeat to compare, taking turns (default: this "
        "kvtrace).")] = None,
    rounds: Annotated[int, typer.Option(
        "--rounds", min=1, help="Rounds of every operation (medians are reported).")] = 1,
    timeout_s: Annotated[float, typer.Option(
        "--timeout", min=1, help="Seconds after which an operation is stopped (and not run "
        "at larger sizes in that tree).")] = 600.0,
    max_rss_mb: Annotated[float, typer.Option(
        "--max-memory", min=100, help="MiB of address space an operation may take.")] = 6000.0,
    as_json: Json = False,
) -> None:
    """Import, log, report and export of one long conversation: time and memory growth."""
    from kvtrace.bench.longrun import run_long_bench

    _print_figures(run_long_bench(turns=tuple(turns or (1000, 10000)), trees=tuple(trees or ()),
                                  rounds=rounds, timeout_s=timeout_s, max_rss_mb=max_rss_mb),
                   as_json)


@bench_app.command("scale")
def bench_scale(
    url: Annotated[str | None, typer.Option(
        "--url", help="An empty store to build in, e.g. a new PostgreSQL schema (default: a "
        "new SQLite file in a temp folder).")] = None,
    num_steps: Annotated[int, typer.Option(
        "--steps", help="Steps at the largest size; the others are a tenth and a hundredth "
        "of it.")] = 1_000_000,
    analyze_steps: Annotated[int, typer.Option(
        "--analyze-steps", min=0, help="Steps of the run analyze reads (0: skip analyze).")] = 1000,
    trials: Annotated[int, typer.Option(
        "--trials", min=1, help="Runs of each operation per size (the median counts).")] = 15,
    control_url: Annotated[str | None, typer.Option(
        "--control-url", help="An empty store for the control, built to the smallest size and "
        "timed beside the growing one (default without --url: a new SQLite file; with --url: "
        "no control).")] = None,
    model: Model = None,
    as_json: Json = False,
) -> None:
    """A store of many agent runs grown 100x: one run's operations, import and fsck at each size."""
    from kvtrace.bench.scale import run_scale_bench

    _print_figures(run_scale_bench(url, num_steps=num_steps, analyze_steps=analyze_steps,
                                   model=model, trials=trials, control_url=control_url,
                                   progress=lambda text: typer.echo(text, err=True)), as_json)
