"""Replay commands: replay, checkout, continue, branch, analyze. Each is one call of
`kvtrace.replay` (`replay` of several runs: `select_runs`, then `replay_runs`).

The local backend keeps its disk tier under the kvtrace cache directory
($KVTRACE_CACHE or ~/.cache/kvtrace), so `checkout` in one process warms
`continue` in the next. Backends and tokenizers are handed to the API
unloaded (`_Lazy`): the API checks its input first, so bad input fails in
a fraction of a second instead of after a model load. `--mode` takes the
library's `ReplayMode`; `--backend` is checked as it is parsed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from kvtrace.cli.app import (
    Dtype,
    Json,
    Model,
    Precision,
    announce_conversion,
    app,
    print_json,
    read_edit,
    say,
    store_url,
)
from kvtrace.errors import UsageError
from kvtrace.paths import default_cache_dir
from kvtrace.replay.report import ReplayMode
from kvtrace.store import open_store
from kvtrace.store.kinds import ModelCall, ToolCall, view

if TYPE_CHECKING:  # the engine imports torch: loaded inside the commands
    from kvtrace.replay.backend import Backend, Tokenizer
    from kvtrace.replay.continuation import Tool


class ToolSet(StrEnum):
    """The tools `--tools` offers a continued run (Python callers register any)."""

    DEMO = "demo"  # the example's deterministic calculator and lookup
    NONE = "none"  # no tools: a tool call stops the run with an error naming the tool

    def tools(self) -> dict[str, Tool]:
        from kvtrace.replay.tools import DEMO_TOOLS

        return dict(DEMO_TOOLS) if self is ToolSet.DEMO else {}


def _check_backend(value: str) -> str:
    """`local`, or the base URL of an OpenAI-compatible server (checked as it is parsed)."""
    if value != "local" and not value.startswith(("http://", "https://")):
        raise typer.BadParameter(
            f"{value!r} is neither 'local' nor a base URL starting with http:// or https://")
    return value


BackendOption = Annotated[str, typer.Option(
    "--backend", callback=_check_backend,
    help="'local' (the engine with its two-tier KV cache) or the base URL of an "
    "OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1.")]
TokenizerOption = Annotated[str | None, typer.Option(
    "--tokenizer",
    help="Remote only: a local model folder, or 'default' for the embedded model, whose "
    "tokenizer computes the oracle bound and token positions.")]
ResetCache = Annotated[bool, typer.Option(
    "--reset-cache",
    help="Remote: empty the engine's prefix cache first, so the replay starts cold (vLLM's "
    "/reset_prefix_cache in dev mode, SGLang's /flush_cache, llama.cpp's slot erase); where "
    "the engine refuses, a note says so and the replay goes on.")]
EngineBlockSize = Annotated[int | None, typer.Option(
    "--engine-block-size", min=1,
    help="Remote: the block size the engine's cache reuses whole, where it does not say "
    "(vLLM's /metrics and SGLang's /get_server_info do): the oracle is also shown at it.")]
ApiKey = Annotated[str | None, typer.Option(
    "--api-key", envvar="KVTRACE_API_KEY",
    help="Bearer token for a remote backend ($KVTRACE_API_KEY); never recorded.")]
Tools = Annotated[ToolSet, typer.Option(
    "--tools",
    help="'demo': the deterministic calculator and lookup tools of the example; "
    "'none': no tools, so a tool call stops with an error naming the tool. "
    "Other tools: register Python callables with kvtrace.replay.continue_run().")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Tokens per response.")]


class _Lazy:
    """Stands for an object that is loaded (seconds: a model) at its first use."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._loaded: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._loaded is None:
            self._loaded = self._load()
        return getattr(self._loaded, name)

    def close(self) -> None:
        """Close what was loaded, if anything was and it can be (a remote backend's client)."""
        close = getattr(self._loaded, "close", None)
        if callable(close):
            close()


def _backend(
    backend: str, model: str | None, *, no_cache: bool = False,
    tokenizer: str | None = None, api_key: str | None = None, retries: int | None = None,
    batching: bool = False, dtype: Precision = Precision.AUTO,
    engine_block_size: int | None = None,
) -> Backend:
    """The backend the options name, loaded when the API first uses it; `batching`: a local
    one loaded on the engine thread that decodes generations together (for `branch`)."""
    if backend == "local" and tokenizer is not None:
        raise UsageError("--tokenizer is for remote backends: the local engine has its own")
    if backend == "local" and retries is not None:
        raise UsageError("--retries is for remote backends: the local engine sends no requests")
    if backend != "local" and dtype is Precision.BFLOAT16:
        raise UsageError("--dtype is for the local backend: a remote server computes as it does")
    if backend != "local" and no_cache:
        raise UsageError("--no-cache works with the local backend only")
    if backend == "local" and engine_block_size is not None:
        raise UsageError("--engine-block-size is for remote backends: the local engine "
                         "knows its own")

    def load() -> Backend:
        from kvtrace.engine import load_tokenizer
        from kvtrace.replay import RemoteBackend, RetryPolicy, open_local_backend

        if backend == "local":
            return open_local_backend(model, cache_dir=default_cache_dir(),
                                      use_cache=not no_cache, on_convert=announce_conversion,
                                      batching=batching, dtype=dtype.value)
        local_tokenizer = None
        if tokenizer is not None:
            name = None if tokenizer == "default" else tokenizer
            local_tokenizer = load_tokenizer(name, cache_dir=default_cache_dir(),
                                             on_convert=announce_conversion)
        retry = RetryPolicy(max_attempts=retries + 1) if retries is not None else None
        return RemoteBackend(backend, model=model, api_key=api_key, tokenizer=local_tokenizer,
                             retry=retry, block_size=engine_block_size)

    return cast("Backend", _Lazy(load))


@dataclass(frozen=True, slots=True)
class _Remote:
    """What `replay` asks of a remote engine besides answers: a cold start, its block size."""

    reset_cache: bool
    block_size: int | None


@contextmanager
def _closing(backend: Backend) -> Iterator[Backend]:
    """Use `backend`, then close it if it holds connections (RemoteBackend does)."""
    try:
        yield backend
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            close()


@app.command("replay")
def replay_command(
    ctx: typer.Context,
    runs: Annotated[list[str] | None, typer.Argument(
        help="The runs to replay: names, step addresses, or globs over run names (quote "
        "them: 'eval-*'). Several, a glob or --all print one report of every run.")] = None,
    every: Annotated[bool, typer.Option(
        "--all", help="Replay every run that has steps.")] = False,
    concurrency: Annotated[int, typer.Option(
        "--concurrency", min=1,
        help="Runs replayed at once, each with one request in flight (a remote --backend; "
        "the steps of a run always go in order).")] = 1,
    retries: Annotated[int | None, typer.Option(
        "--retries", min=0,
        help="Remote: times a request is sent again after a connect error, HTTP 429 or 5xx, "
        "with growing waits (Retry-After honoured); default 4.")] = None,
    mode: Annotated[ReplayMode, typer.Option(
        "--mode",
        help="verify: regenerate each response and compare with the recording; "
        "rebuild: feed the recorded outputs to rebuild the KV state fast.")] = ReplayMode.REBUILD,
    to: Annotated[str | None, typer.Option(
        "--to", help="Stop at this step (RUN@N, RUN~K, id prefix); default: the head.")] = None,
    backend: BackendOption = "local",
    model: Model = None,
    dtype: Dtype = Precision.AUTO,
    tokenizer: TokenizerOption = None,
    api_key: ApiKey = None,
    reset_cache: ResetCache = False,
    engine_block_size: EngineBlockSize = None,
    no_cache: Annotated[bool, typer.Option(
        "--no-cache",
        help="Compute every token (local backend): the uncached baseline.")] = False,
    compare_uncached: Annotated[bool, typer.Option(
        "--compare-uncached",
        help="Then replay again with caching off and report the speed-up.")] = False,
    no_draft: Annotated[bool, typer.Option(
        "--no-draft",
        help="Verify: decode every response token by token instead of first checking "
        "the recorded one in a single pass (decoding's own verdicts, slower).")] = False,
    as_json: Json = False,
) -> None:
    """Replay runs from their root through a backend, reporting KV reuse per step.

    One run: its table of steps. Several (names, globs, --all): one report of every run,
    up to --concurrency at once; a run that fails is reported and the others go on.
    """
    from kvtrace.replay.runs import is_glob

    if no_draft and mode is not ReplayMode.VERIFY:
        raise UsageError("--no-draft applies to --mode verify only")
    if reset_cache and backend == "local":
        raise UsageError("--reset-cache empties a remote engine's cache: the local engine "
                         "replays uncached with --no-cache")
    remote = _Remote(reset_cache, engine_block_size)
    names = runs or []
    if not names and not every:
        raise UsageError("name a run to replay (or several, a glob such as 'eval-*', or --all)")
    if every or len(names) > 1 or is_glob(names[0]):
        _replay_many(ctx, names, every=every, concurrency=concurrency, retries=retries,
                     mode=mode, to=to, backend=backend, model=model, dtype=dtype,
                     tokenizer=tokenizer,
                     api_key=api_key, no_cache=no_cache, compare_uncached=compare_uncached,
                     use_drafts=not no_draft, as_json=as_json, remote=remote)
        return
    _replay_one(ctx, names[0], retries=retries, mode=mode, to=to, backend=backend, model=model,
                dtype=dtype, tokenizer=tokenizer, api_key=api_key, no_cache=no_cache,
                compare_uncached=compare_uncached, use_drafts=not no_draft, as_json=as_json,
                remote=remote)


def _replay_one(
    ctx: typer.Context, run: str, *, retries: int | None, mode: ReplayMode, to: str | None,
    backend: str, model: str | None, dtype: Precision, tokenizer: str | None,
    api_key: str | None, no_cache: bool, compare_uncached: bool, use_drafts: bool,
    as_json: bool, remote: _Remote,
) -> None:
    """`replay RUN`: one run, its table of steps (`kvtrace.replay.replay`)."""
    from kvtrace.cli.render import progress_bar, render_replay
    from kvtrace.replay import replay

    chosen = _backend(backend, model, no_cache=no_cache, tokenizer=tokenizer, api_key=api_key,
                      retries=retries, dtype=dtype, engine_block_size=remote.block_size)
    with _closing(chosen), open_store(store_url(ctx), create=False) as store:
        if as_json:
            report = replay(store, run, chosen, to=to, mode=mode,
                            compare_uncached=compare_uncached, use_drafts=use_drafts,
                            reset_cache=remote.reset_cache)
            print_json(report.to_dict())
            if report.stopped is not None:
                raise typer.Exit(1)
            return
        with progress_bar(f"{mode} {run}") as on_step:
            report = replay(store, run, chosen, to=to, mode=mode,
                            compare_uncached=compare_uncached, use_drafts=use_drafts,
                            on_step=on_step, reset_cache=remote.reset_cache)
    render_replay(report)
    if report.is_match is False or report.stopped is not None:
        raise typer.Exit(1)


def _replay_many(
    ctx: typer.Context, names: list[str], *, every: bool, concurrency: int,
    retries: int | None, mode: ReplayMode, to: str | None, backend: str, model: str | None,
    dtype: Precision, tokenizer: str | None, api_key: str | None, no_cache: bool,
    compare_uncached: bool, use_drafts: bool, as_json: bool, remote: _Remote,
) -> None:
    """`replay RUN RUN ...`, a glob or `--all`: one report of every run
    (`kvtrace.replay.replay_runs`); exit 1 when a run failed or differs."""
    from kvtrace.cli.render import render_runs, runs_progress
    from kvtrace.replay import replay_runs, select_runs

    if to is not None:
        raise UsageError("--to stops one run: with several, name a step of each (RUN@N)")
    if compare_uncached:
        raise UsageError("--compare-uncached replays one run: name one")
    if concurrency > 1 and backend == "local":
        raise UsageError("--concurrency above 1 needs a remote --backend URL: the local "
                         "engine answers one call at a time")
    chosen = _backend(backend, model, no_cache=no_cache, tokenizer=tokenizer, api_key=api_key,
                      retries=retries, dtype=dtype, engine_block_size=remote.block_size)
    with _closing(chosen), open_store(store_url(ctx), create=False) as store:
        selected = select_runs(store, names, every=every)
        if as_json:
            report = replay_runs(store, selected, chosen, concurrency=concurrency, mode=mode,
                                 use_drafts=use_drafts, reset_cache=remote.reset_cache)
            print_json(report.to_dict())
        else:
            with runs_progress(len(selected), f"{mode} {len(selected)} runs") as progress:
                report = replay_runs(store, selected, chosen, concurrency=concurrency,
                                     mode=mode, use_drafts=use_drafts, progress=progress,
                                     reset_cache=remote.reset_cache)
    if not as_json:
        render_runs(report)
    if not report.is_ok:
        raise typer.Exit(1)


@app.command("checkout")
def checkout_command(
    ctx: typer.Context,
    spec: Annotated[str, typer.Argument(
        help="The step whose KV state to rebuild (RUN, RUN@N, ...).")],
    model: Model = None,
    dtype: Dtype = Precision.AUTO,
    as_json: Json = False,
) -> None:
    """Rebuild a step's KV state into the local cache so a later continue starts warm."""
    from kvtrace.cli.render import progress_bar, render_replay
    from kvtrace.engine import DEFAULT_BLOCK_SIZE
    from kvtrace.engine.maintenance import default_kv_dir
    from kvtrace.replay import checkout

    chosen = _backend("local", model, dtype=dtype)
    with open_store(store_url(ctx), create=False) as store:
        if as_json:
            print_json(checkout(store, spec, chosen).to_dict())
            return
        with progress_bar(f"checkout {spec}") as on_step:
            report = checkout(store, spec, chosen, on_step=on_step)
    render_replay(report)
    say(f"KV state of {spec}: whole {DEFAULT_BLOCK_SIZE}-token blocks on disk under "
               f"{default_kv_dir(default_cache_dir())} (a later process recomputes only the "
               "tail)")


@app.command("continue")
def continue_command(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="The run to continue (usually a fork).")],
    steps: Annotated[int, typer.Option("--steps", help="At most this many new model calls.")],
    tools: Tools = ToolSet.NONE,
    backend: BackendOption = "local",
    model: Model = None,
    dtype: Dtype = Precision.AUTO,
    api_key: ApiKey = None,
    max_new_tokens: MaxNewTokens = 96,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="0 means greedy.")] = 0.0,
    seed: Annotated[int | None, typer.Option(
        "--seed", help="Sampling seed (with --temperature > 0).")] = None,
    as_json: Json = False,
) -> None:
    """Generate new steps live on a run (ReAct tool calls, see docs/replay.md) and record them."""
    from kvtrace.replay import SamplingParams, continue_run
    from kvtrace.replay.report import Totals

    params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens)
    chosen = _backend(backend, model, api_key=api_key, dtype=dtype)
    with _closing(chosen), open_store(store_url(ctx), create=False) as store:
        result = continue_run(store, run, chosen, steps=steps, tools=tools.tools(),
                              params=params)
    if as_json:
        print_json(result.to_dict())
        return
    for step in result.new_steps:
        typed = view(step)
        what = (typed.tool if isinstance(typed, ToolCall) else
                typed.model or "" if isinstance(typed, ModelCall) else "")
        say(f"{step.depth:>4}  {step.short_id}  {step.kind:<10}  {what}")
    total = Totals.of(result.reports)
    calls = total.steps
    say(f"{calls} model call{'' if calls == 1 else 's'}, {total.reused_tokens or 0}/"
               f"{total.prompt_tokens} prompt tokens reused"
               + (f"; final answer: {result.final_answer}" if result.is_finished else ""))


@app.command("branch")
def branch_command(
    ctx: typer.Context,
    spec: Annotated[str, typer.Argument(
        help="The step to branch from (RUN, RUN@N, RUN~K, id).")],
    n: Annotated[int, typer.Option(
        "--n", help="How many branches (runs) to fork and continue.")],
    steps: Annotated[int, typer.Option(
        "--steps", help="At most this many model calls per branch.")] = 3,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="Sampling temperature.")] = 0.7,
    seed: Annotated[int, typer.Option(
        "--seed", help="Branch i samples with seed S + i - 1.")] = 0,
    edit: Annotated[str | None, typer.Option(
        "--edit",
        help="A JSON file mapping the step's content fields to new values (e.g. "
        '{"result": "..."} for a tool call): branches start from the edited copy.')] = None,
    prefix: Annotated[str | None, typer.Option(
        "--prefix", help="Branch runs are named PREFIX-1, ...")] = None,
    tools: Tools = ToolSet.NONE,
    model: Model = None,
    dtype: Dtype = Precision.AUTO,
    max_new_tokens: MaxNewTokens = 96,
    as_json: Json = False,
) -> None:
    """Fork K runs from one step and continue each, sharing the prefix's KV; compare them."""

    from kvtrace.replay import SamplingParams
    from kvtrace.replay.branch import branch_out

    changes = read_edit(edit) if edit is not None else None
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    chosen = _backend("local", model, batching=True, dtype=dtype)
    with _closing(chosen), open_store(store_url(ctx), create=False) as store:
        report = branch_out(store, spec, chosen, n=n, prefix=prefix, steps=steps,
                            tools=tools.tools(), params=params, seed=seed, edit=changes)
    if as_json:
        print_json(report.to_dict())
        return
    say(f"{len(report.branches)} branches from {report.fork_step.short_id} "
               f"(@{report.fork_step.depth}{', edited' if changes else ''}); prefix of "
               f"{report.prefix_tokens} tokens computed once ({report.prefix_computed_tokens} "
               "computed, the rest from the cache)")
    say(f"{'run':<24} {'seed':>5} {'steps':>5} {'prompt':>7} {'computed':>8} "
               f"{'output':>6} {'diverges':>8}  final output")
    for branch in report.branches:
        row = branch.to_dict()
        where = "-" if row["diverged_at"] is None else f"@{row['diverged_at']}"
        text = " ".join(str(row["output"]).split())
        say(f"{row['run']:<24} {row['seed']!s:>5} {row['steps']:>5} "
                   f"{row['prompt_tokens']:>7} {row['computed_tokens']!s:>8} "
                   f"{row['output_tokens']:>6} {where:>8}  {text[:60]}")


@app.command("analyze")
def analyze_command(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="The run (or step) to analyze.")],
    model: Model = None,
    backend: Annotated[str | None, typer.Option(
        "--backend", callback=lambda v: None if v is None else _check_backend(v),
        help="Count in the token ids of the engine at this base URL, rendered by its own "
        "template (its /tokenize: vLLM, kvtrace serve; llama.cpp's /apply-template), as a "
        "replay through it counts.")] = None,
    prices: Annotated[Path | None, typer.Option(
        "--prices",
        help="Prices per million tokens by model (JSON, or TOML ending in .toml; see "
        "docs/replay.md): adds the cost as billed and without the cache.")] = None,
    as_json: Json = False,
) -> None:
    """Oracle bound, the provider's cache reads and writes, and prefix breakers, per step.

    Tokenizer only (no forward pass). With --prices, the cost per step and in total.
    """
    import httpx

    from kvtrace.cli.render import render_analysis
    from kvtrace.engine import load_tokenizer
    from kvtrace.replay import analyze
    from kvtrace.replay.engines import engine_tokenizer
    from kvtrace.replay.prices import read_prices

    if backend is not None and (model is not None or backend == "local"):
        raise UsageError("--backend URL counts in a remote engine's tokens: drop --model, or "
                         "--backend")
    price_list = read_prices(prices) if prices is not None else None
    with httpx.Client() as client, open_store(store_url(ctx), create=False) as store:
        tokenizer = cast("Tokenizer", engine_tokenizer(client, backend) if backend else _Lazy(
            lambda: load_tokenizer(model, cache_dir=default_cache_dir(),
                                   on_convert=announce_conversion)))
        analysis = analyze(store, run, tokenizer, prices=price_list)
    if as_json:
        print_json(analysis.to_dict())
        return
    render_analysis(analysis)
