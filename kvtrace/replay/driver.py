"""Replay: walk a run's steps from the root to a target and send model calls to a backend.

Tool calls are never executed: their recorded results are already in the
messages of the model calls that follow, so serving the trace is enough
(like a VCR cassette). Other step kinds (notes, http) are skipped.

Modes:
- ``verify`` regenerates every response with its recorded sampling
  parameters (greedy when none were recorded) and reports, per step, a match
  or the first differing token. The recorded response goes along as a
  draft (``use_drafts=False`` turns that off): the local engine checks it in
  one pass and decodes only when it is rejected, with the same result;
- ``rebuild`` feeds each recorded output instead of generating, which is how
  ``checkout`` warms a cache with a run's KV up to any step.

What the local cache recovered from is shown, never only counted: a disk
block found damaged is named in a note at the step that found it (deleted
and recomputed), and blocks that could not be written (a full or read-only
disk) in one note at the end, with the reason.

The oracle bound is computed alongside, from token ids: before each call,
the longest prefix the prompt shares with any sequence this replay has sent
so far (prompt + output: the generated output in verify, the recorded one in
rebuild; in verify also the recorded one when the backend checked it as a
draft, since its cache then holds it), capped at len - 1. On an empty cache
whose budget holds the working set, a correct exact-prefix cache reuses
exactly that much.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvtrace.apis.chat import arguments_equal, tool_calls_of
from kvtrace.engine.sampling import SamplingParams
from kvtrace.errors import BackendError, KvtraceError, ReplayError, UsageError
from kvtrace.rendering import content_text, parse_assistant_text
from kvtrace.replay.backend import Backend, CallRequest, Message, Tokenizer
from kvtrace.replay.engines import counters_grown
from kvtrace.replay.oracle import PrefixOracle, common_prefix_length
from kvtrace.replay.recording import (
    context_limit,
    expected_output_ids,
    prompt_ids,
    response_message,
    response_text,
    step_messages,
    step_tools,
    templated_output_ids,
)
from kvtrace.replay.report import Mismatch, ReplayMode, ReplayReport, StepReport, Stopped
from kvtrace.replay.retry import tally
from kvtrace.store import Step, Store
from kvtrace.store.kinds import ModelCall, StepKind

if TYPE_CHECKING:
    from kvtrace.engine.faults import DiskFaults

ProgressCallback = Callable[[int, int, StepReport], None]  # (done, total, step report)
_SNIPPET_TOKENS = 12


@dataclass(frozen=True, slots=True)
class _Expected:
    """A recorded model call, prepared for a backend."""

    step: Step
    request: CallRequest
    expected_ids: list[int] | None
    expected_text: str
    response: Message


def replay(
    store: Store,
    spec: str,
    backend: Backend,
    *,
    to: str | None = None,
    mode: ReplayMode | str = ReplayMode.REBUILD,
    compare_uncached: bool = False,
    use_drafts: bool = True,
    on_step: ProgressCallback | None = None,
    reset_cache: bool = False,
) -> ReplayReport:
    """Replay the run (or step) `spec` from its root through `backend`, up to step `to`.

    With `compare_uncached`, the same replay is then run again with caching
    off, and the report carries it (`report.uncached`, `report.speedup`).
    `use_drafts=False` makes verify decode every response token by token even
    where the backend could check the recorded one in one pass. `reset_cache`
    empties a remote engine's cache first (`cold_start`).
    """
    path = steps_to_replay(store, spec, to=to, mode=mode)
    reset, refused = cold_start(backend) if reset_cache else (None, None)
    report = replay_steps(spec, path, backend, mode=mode, compare_uncached=compare_uncached,
                          use_drafts=use_drafts, on_step=on_step)
    return replace(report, reset=reset, notes=[*([refused] if refused else []), *report.notes])


def cold_start(backend: Backend) -> tuple[str | None, str | None]:
    """Empty the backend's cache: (the endpoint that did, None), or (None, the line saying
    it could not, and that the replay goes on with what the engine holds)."""
    try:
        return backend.reset_cache(), None
    except BackendError as exc:
        return None, f"the cache was not reset: {exc}; the replay starts on what it holds"


def replay_steps(
    spec: str,
    path: list[Step],
    backend: Backend,
    *,
    mode: ReplayMode | str = ReplayMode.REBUILD,
    compare_uncached: bool = False,
    use_drafts: bool = True,
    on_step: ProgressCallback | None = None,
    tokenizer: Tokenizer | None = None,
    count_engine: bool = True,
) -> ReplayReport:
    """`replay` of steps already read (`steps_to_replay`): no store needed from here on.

    `tokenizer` stands in for the backend's (`replay_runs` hands in one that
    several threads may share). `count_engine=False` leaves a remote engine's
    counters unread: runs replayed at once share them (`replay_runs` reads them
    around all of its runs).
    """
    mode = replay_mode(mode)
    uncached_backend = backend.without_cache() if compare_uncached else None  # fails early
    tokenizer = tokenizer or backend.tokenizer
    before = backend.engine_counters() if count_engine else None
    report = _replay_path(spec, path, backend, tokenizer, mode, use_drafts, on_step)
    if before is not None:
        report = replace(report, engine_counters=counters_grown(before,
                                                                backend.engine_counters()))
    if uncached_backend is not None:
        uncached = _replay_path(spec, path, uncached_backend, tokenizer, mode, use_drafts,
                                on_step)
        report = replace(report, uncached=uncached)
    return report


def steps_to_replay(
    store: Store, spec: str, *, to: str | None = None, mode: ReplayMode | str = ReplayMode.REBUILD
) -> list[Step]:
    """The steps a replay of `spec` up to `to` walks, after checking every argument.

    Cheap (no model), and done before the backend is first used, so bad input
    fails at once (the CLI loads its backend lazily).
    """
    replay_mode(mode)
    path = store.path(spec)
    if not path:
        raise ReplayError(f"{spec!r} has no steps to replay")
    if to is not None:
        target = store.resolve(to)
        ids = [step.id for step in path]
        if target not in ids:
            raise UsageError(
                f"to={to!r} is not a step of {spec!r} (not one of its {len(path)} steps "
                "from the root): name a step on it (RUN@N, RUN~K or an id prefix)", param="to"
            )
        path = path[: ids.index(target) + 1]
    return path


def checkout(
    store: Store, spec: str, backend: Backend, *, on_step: ProgressCallback | None = None
) -> ReplayReport:
    """Rebuild the KV state of `spec` in the backend's cache, so a continue starts warm.

    With the local backend the memory tier holds it for this process and the
    disk tier for later ones.
    """
    return replay(store, spec, backend, mode=ReplayMode.REBUILD, on_step=on_step)


def replay_mode(mode: ReplayMode | str) -> ReplayMode:
    """`mode` as a ReplayMode, or UsageError naming the modes."""
    try:
        return ReplayMode(mode)
    except ValueError:
        choices = ", ".join(ReplayMode)
        raise UsageError(f"unknown replay mode {mode!r}: use one of {choices}",
                         param="mode") from None


def _replay_path(
    spec: str,
    path: list[Step],
    backend: Backend,
    tokenizer: Tokenizer | None,
    mode: ReplayMode,
    use_drafts: bool,
    on_step: ProgressCallback | None,
) -> ReplayReport:
    model_steps = [s for s in path if s.kind == StepKind.MODEL_CALL]
    tool_steps = sum(1 for s in path if s.kind == StepKind.TOOL_CALL)
    engine = backend.engine_facts
    notes: list[str] = list(engine.notes) if engine is not None else []
    if tokenizer is None and (engine is None or not engine.notes):
        notes.append("no tokenizer for this backend: oracle bound and token positions unknown "
                     "(give the backend the tokenizer of the server's model)")
    num_fitting, stopped, broken = _fitting(model_steps, tokenizer, mode, use_drafts)
    if stopped is not None:  # said now, before minutes of replay; the report ends with it
        warnings.warn(f"{stopped.line()}: replaying the {num_fitting} model calls before "
                      "it", stacklevel=3)
    oracle = PrefixOracle()
    faults = _FaultNotes()
    reports: list[StepReport] = []
    retried: list[str] = []
    unreported = 0  # answers without usage
    started = time.perf_counter()
    for index, step in enumerate(model_steps[:num_fitting], start=1):
        expected = _prepare(step, tokenizer, mode, use_drafts)
        request = expected.request
        oracle_tokens = oracle.bound(request.prompt_ids) if request.prompt_ids else None
        if mode is ReplayMode.VERIFY:
            result = backend.generate(request)
            fed = result.output_ids
            if fed is None and tokenizer is not None and request.prompt_ids is not None:
                said = parse_assistant_text(result.text) if request.tools else result.text
                fed = templated_output_ids(tokenizer, request.messages, said,
                                           request.prompt_ids, tools=request.tools)
        else:
            result = backend.rebuild(request)
            fed = request.output_ids if result.is_output_fed else None
        retried.extend(result.retries)
        unreported += result.is_usage_missing
        if request.prompt_ids is not None:
            oracle.add([*request.prompt_ids, *(fed or [])], label=step.id)
            if result.draft is not None and request.draft_ids:
                oracle.add([*request.prompt_ids, *request.draft_ids], label=step.id)
        if request.prompt_ids is not None and result.prompt_tokens != len(request.prompt_ids):
            notes.append(f"step @{step.depth}: the backend counted {result.prompt_tokens} "
                         f"prompt tokens, the tokenizer {len(request.prompt_ids)}; the oracle "
                         "is in the latter")
        is_match, mismatch = (None, None)
        if mode is ReplayMode.VERIFY:
            is_match, mismatch = _compare(expected, result.text, fed, tokenizer)
        step_report = StepReport.of(
            index, step, result, oracle_tokens=oracle_tokens,
            output_tokens=len(fed) if fed is not None else len(request.output_ids or []),
            is_match=is_match,
            mismatch=mismatch, resume_every=backend.resume_every,
            oracle_prompt_tokens=len(request.prompt_ids) if request.prompt_ids else None,
        )
        reports.append(step_report)
        notes.extend(faults.add(backend.take_cache_faults(), f"step @{step.depth}"))
        if on_step is not None:
            on_step(index, num_fitting, step_report)
    if broken is not None:  # fails now, at its turn, after the calls before it
        _prepare(broken, tokenizer, mode, use_drafts)
    backend.settle()  # what verify's last output left owed: on disk, as the rest
    notes.extend(faults.add(backend.take_cache_faults(), "storing the last output"))
    notes.extend(faults.write_notes())
    if unreported:
        counted = "the tokenizer's count" if tokenizer is not None else "0 (no tokenizer)"
        notes.append(f"the engine answered {unreported} of {len(reports)} calls without usage: "
                     f"their prompt tokens are {counted} and their reuse is unknown")
    if retried:  # recovered from, but shown: a flaky server is worth knowing about
        notes.append(f"the backend was sent {len(retried)} request"
                     f"{'' if len(retried) == 1 else 's'} again after a failure "
                     f"({tally(retried)}); every step got its answer")
    wall = time.perf_counter() - started
    return ReplayReport(spec, path[-1].id, mode, backend.name, backend.model, reports,
                        tool_steps, wall, notes=notes, stopped=stopped, engine=engine)


def _fitting(model_steps: list[Step], tokenizer: Tokenizer | None, mode: ReplayMode,
             use_drafts: bool) -> tuple[int, Stopped | None, Step | None]:
    """How many model calls fit the model's context before the first that does not (then:
    where it stopped, and how many calls were left), or before one that cannot be prepared
    (then: that step, whose error the replay raises at its turn). Each call is prepared and
    let go: held all at once, a long run's prompts would fill memory."""
    for index, step in enumerate(model_steps):
        try:
            expected = _prepare(step, tokenizer, mode, use_drafts)
        except KvtraceError:
            return index, None, step
        prompt = expected.request.prompt_ids
        if tokenizer is not None and prompt is not None:
            response = len(expected.expected_ids or [])
            limit = context_limit(tokenizer, len(prompt) + response)
            if limit is not None:
                return index, Stopped(step.depth, step.id, len(prompt), response, limit,
                                      len(model_steps) - index), None
    return len(model_steps), None, None


class _FaultNotes:
    """The cache's faults as report notes: a damaged block where found; failed writes and
    evictions once, at the end."""

    def __init__(self) -> None:
        self.total: DiskFaults | None = None

    def add(self, faults: DiskFaults | None, where: str) -> list[str]:
        """Notes for the blocks found damaged (`where`: the step); the rest kept for later."""
        if not faults:
            return []
        self.total = faults if self.total is None else self.total.plus(faults)
        notes = [f"{where}: KV block {fault.key[:16]} on disk failed its check "
                 f"({fault.reason}): "
                 + ("it was deleted and its tokens were recomputed" if fault.is_deleted else
                    "its tokens were recomputed; the file could not be deleted (read-only)")
                 for fault in faults.damaged]
        if faults.num_damaged > len(faults.damaged):
            notes.append(f"{where}: {faults.num_damaged - len(faults.damaged)} more damaged KV "
                         "blocks were deleted and their tokens recomputed")
        return notes

    def write_notes(self) -> list[str]:
        if self.total is None:
            return []
        from kvtrace.engine.faults import disk_faults_lines  # no torch: stdlib only

        return disk_faults_lines(self.total)


def _prepare(
    step: Step, tokenizer: Tokenizer | None, mode: ReplayMode, use_drafts: bool
) -> _Expected:
    messages = step_messages(step)
    text = response_text(step)
    prompt = prompt_ids(tokenizer, step) if tokenizer is not None else None
    expected_ids = (
        expected_output_ids(step, tokenizer, prompt)
        if tokenizer is not None and prompt is not None
        else None
    )
    # Regenerate as long as the recording, so a run-on is caught at the stop token.
    call = ModelCall(step)
    recorded = SamplingParams.from_recorded(
        call.params,
        default_max_new_tokens=max(len(expected_ids), 1) if expected_ids else 256,
    )
    if expected_ids and mode is ReplayMode.VERIFY and recorded.max_new_tokens < len(expected_ids):
        raise ReplayError(
            f"step {step.short_id} records max_new_tokens={recorded.max_new_tokens} "
            f"but its response has {len(expected_ids)} tokens: the recording is inconsistent"
        )
    verify = mode is ReplayMode.VERIFY
    request = CallRequest(messages, prompt, recorded,
                          output_ids=None if verify else expected_ids,
                          output_text=text, model=call.model,
                          draft_ids=expected_ids if verify and use_drafts else None,
                          tools=step_tools(step))
    return _Expected(step, request, expected_ids, text, response_message(step))


def _compare(
    expected: _Expected, got_text: str, got_ids: list[int] | None, tokenizer: Tokenizer | None
) -> tuple[bool, Mismatch | None]:
    """Match, or the first differing token (characters when no token ids are known).

    Tool calls count as equal when names and arguments are equal as JSON, so a
    regenerated call spelled with other whitespace or key order still matches.
    """
    want = expected.expected_ids
    if want is not None and got_ids is not None and got_ids == want:
        return True, None
    if want is None and got_text == expected.expected_text:
        return True, None
    difference = _tool_call_difference(expected.response, got_text)
    if difference is None and tool_calls_of(expected.response):
        return True, None
    if want is not None and got_ids is not None and tokenizer is not None:
        at = common_prefix_length(want, got_ids)
        return False, Mismatch(
            position=at,
            expected_id=want[at] if at < len(want) else None,
            got_id=got_ids[at] if at < len(got_ids) else None,
            expected_text=tokenizer.decode(want[at : at + _SNIPPET_TOKENS],
                                           skip_special_tokens=False),
            got_text=tokenizer.decode(got_ids[at : at + _SNIPPET_TOKENS],
                                      skip_special_tokens=False),
            tool_call=difference,
        )
    at = common_prefix_length(expected.expected_text, got_text)
    return False, Mismatch(at, None, None, expected.expected_text[at : at + 40],
                           got_text[at : at + 40], unit="char", tool_call=difference)


def _tool_call_difference(expected: Message, got_text: str) -> str | None:
    """How the regenerated tool calls differ from the recorded ones (None: they agree)."""
    want = tool_calls_of(expected)
    got = tool_calls_of(parse_assistant_text(got_text))
    if not want and not got:
        return None
    for index in range(max(len(want), len(got))):
        if index >= len(want) or index >= len(got):
            return (f"{len(want)} tool call(s) recorded, {len(got)} regenerated")
        a, b = want[index]["function"], got[index]["function"]
        if a.get("name") != b.get("name"):
            return f"tool call {index}: {a.get('name')!r} recorded, {b.get('name')!r} regenerated"
        if not arguments_equal(str(a.get("arguments", "")), str(b.get("arguments", ""))):
            return (f"tool call {index} ({a.get('name')}): arguments {a.get('arguments')} "
                    f"recorded, {b.get('arguments')} regenerated")
    if content_text(expected.get("content")).strip() != content_text(
        parse_assistant_text(got_text).get("content")
    ).strip():
        return "same tool calls, other text"
    return None
