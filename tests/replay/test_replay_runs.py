"""Many runs replayed through one remote backend, several requests in flight, one report.

Against the stand-in OpenAI server of conftest.py on a real loopback socket
(it can fail requests: 503, 429 with Retry-After, a dropped connection), and
against `kvtrace serve` on a tiny model.
"""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from kvtrace.errors import BackendError, NotFoundError, UsageError
from kvtrace.replay import (
    RemoteBackend,
    RetryPolicy,
    RunStatus,
    replay,
    replay_runs,
    select_runs,
)
from kvtrace.replay.retry import is_retried_status, retry_after_s
from tests.replay.conftest import DROP

FAST = RetryPolicy(max_attempts=5, base_delay_s=0.001, max_delay_s=5)


def _answer(messages):
    return f"Final Answer: {len(messages)} messages"


def _record(store, name, calls, topic=None):
    """A run of `calls` model calls; its system prompt names `topic` (default: the name)."""
    run = store.run(name)
    messages = [{"role": "system", "content": f"You are terse. Topic: {topic or name}."},
                {"role": "user", "content": "Question: count the messages."}]
    for i in range(calls):
        run.record_model_call(list(messages), _answer(messages), model="stand-in",
                              params={"temperature": 0, "max_tokens": 64})
        run.record_tool_call("count", {"turn": i}, i)
        messages += [{"role": "assistant", "content": _answer(messages)},
                     {"role": "user", "content": f"Observation: turn {i}"}]


def _per_run(report):
    """What a run's replay must give whatever ran beside it (timings aside).

    Reuse on a run's first call is left out: the server's cache is shared, so
    it may hold another run's `<s>system` prefix or not, by schedule.
    """
    return {
        outcome.run: [(s.step_id, s.depth, s.prompt_tokens, s.oracle_tokens, s.output_tokens,
                       s.is_match, s.mismatch, s.reused_tokens if s.index > 1 else None)
                      for s in outcome.report.steps]
        for outcome in report.runs
    }


@pytest.fixture
def six_runs(replay_store):
    for i, calls in enumerate([3, 5, 2, 4, 1, 3]):
        _record(replay_store, f"eval-{i}", calls)
    return replay_store


def test_runs_at_concurrency_4_give_each_run_what_concurrency_1_gives(
    six_runs, stand_in_server, byte_tokenizer
):
    names = select_runs(six_runs, ["eval-*"])
    one = stand_in_server(_answer)
    serial = replay_runs(six_runs, names, RemoteBackend(one.url, tokenizer=byte_tokenizer),
                         concurrency=1, mode="verify")
    four = stand_in_server(_answer, hold_first_until=2)
    parallel = replay_runs(six_runs, names, RemoteBackend(four.url, tokenizer=byte_tokenizer),
                           concurrency=4, mode="verify")
    assert [o.run for o in parallel.runs] == names  # in the order asked, not of finishing
    assert _per_run(parallel) == _per_run(serial)
    assert parallel.is_ok and all(o.status is RunStatus.OK for o in parallel.runs)
    assert parallel.total.steps == serial.total.steps == 18
    assert parallel.total.oracle_tokens == serial.total.oracle_tokens
    assert one.max_in_flight == 1
    assert four.held_first and 2 <= four.max_in_flight <= 4  # concurrent, never past the cap


def test_each_run_in_the_report_is_what_replaying_it_alone_gives(
    six_runs, stand_in_server, byte_tokenizer
):
    report = replay_runs(six_runs, ["eval-1", "eval-3"],
                         RemoteBackend(stand_in_server(_answer).url, tokenizer=byte_tokenizer),
                         concurrency=2)
    for outcome in report.runs:
        alone = replay(six_runs, outcome.run,
                       RemoteBackend(stand_in_server(_answer).url, tokenizer=byte_tokenizer))
        assert [(s.step_id, s.prompt_tokens, s.oracle_tokens, s.reused_tokens)
                for s in alone.steps][1:] == [
            (s.step_id, s.prompt_tokens, s.oracle_tokens, s.reused_tokens)
            for s in outcome.report.steps][1:]
    total = report.to_dict()["total"]
    assert total["runs"] == 2 and total["ok_runs"] == 2 and total["failed_runs"] == 0
    assert total["steps"] == 9 and total["tool_steps"] == 9
    assert total["oracle_tokens"] == sum(o.report.total.oracle_tokens for o in report.runs)


def test_a_run_whose_backend_keeps_failing_is_reported_failed_and_the_others_complete(
    replay_store, stand_in_server, byte_tokenizer
):
    for name in ("a", "b", "c"):
        _record(replay_store, name, 3)
    _record(replay_store, "doomed", 3)
    server = stand_in_server(
        _answer, failure=lambda body: (503, {"Retry-After": "0"})
        if "doomed" in body["messages"][0]["content"] else None)
    report = replay_runs(replay_store, ["a", "doomed", "b", "c"],
                         RemoteBackend(server.url, tokenizer=byte_tokenizer, retry=FAST),
                         concurrency=3)
    by_run = {o.run: o for o in report.runs}
    doomed = by_run["doomed"]
    assert doomed.status is RunStatus.FAILED and doomed.report is None
    assert "HTTP 503" in doomed.error and "after 5 attempts (HTTP 503 x4)" in doomed.error
    assert "\n" not in doomed.error
    assert doomed.failed_at == 1 and doomed.num_done == 0  # its first model call, RUN@1
    assert sum("doomed" in b["messages"][0]["content"] for _, b in server.attempts) == 5
    assert [by_run[n].status for n in ("a", "b", "c")] == [RunStatus.OK] * 3
    assert all(len(by_run[n].report.steps) == 3 for n in ("a", "b", "c"))
    assert report.failed == [doomed] and not report.is_ok
    data = report.to_dict()
    assert data["total"]["failed_runs"] == 1 and data["total"]["steps"] == 9
    assert data["runs"][1] == {**data["runs"][1], "status": "failed", "report": None,
                               "failed_at": 1}


def test_a_run_that_fails_midway_says_at_which_step(replay_store, stand_in_server):
    _record(replay_store, "r", 4)
    server = stand_in_server(  # the third model call (5 messages) fails, whatever is retried
        _answer, failure=lambda body: (500, {}) if len(body["messages"]) == 6 else None)
    report = replay_runs(replay_store, ["r"], RemoteBackend(server.url, retry=FAST))
    outcome = report.runs[0]
    assert outcome.num_done == 2 and outcome.failed_at == 5  # @1 call, @2 tool, @3, @4, @5
    assert "HTTP 500" in outcome.error


def test_failed_requests_are_retried_and_the_replay_gives_what_a_healthy_server_gives(
    six_runs, stand_in_server, byte_tokenizer
):
    fails = iter([(503, {}), (429, {"Retry-After": "0"}), DROP, (502, {})])

    def flaky(body):
        return next(fails, None)

    healthy = replay(six_runs, "eval-1",
                     RemoteBackend(stand_in_server(_answer).url, tokenizer=byte_tokenizer))
    server = stand_in_server(_answer, failure=flaky)
    report = replay(six_runs, "eval-1",
                    RemoteBackend(server.url, tokenizer=byte_tokenizer, retry=FAST))
    assert [(s.prompt_tokens, s.reused_tokens, s.oracle_tokens) for s in report.steps] == [
        (s.prompt_tokens, s.reused_tokens, s.oracle_tokens) for s in healthy.steps]
    assert len(server.attempts) == len(report.steps) + 4
    assert any("sent 4 requests again after a failure" in note
               and "RemoteProtocolError x1" in note and "HTTP 503 x1" in note
               for note in report.notes)


def test_retry_after_is_honoured_before_the_next_attempt(replay_store, stand_in_server):
    _record(replay_store, "r", 1)
    fails = iter([(429, {"Retry-After": "1"})])
    server = stand_in_server(_answer, failure=lambda body: next(fails, None))
    replay(replay_store, "r", RemoteBackend(server.url, retry=FAST))
    (first, _), (second, _) = server.attempts
    assert second - first >= 0.95  # the server's own clock: asked for 1 s, got at least that


def test_a_retry_after_longer_than_the_policy_allows_fails_at_once(
    replay_store, stand_in_server
):
    _record(replay_store, "r", 1)
    server = stand_in_server(_answer, failure=lambda body: (503, {"Retry-After": "3600"}))
    with pytest.raises(BackendError, match="asked to retry after 3600 s, longer than the "
                                           "retry policy's max_delay_s=5"):
        replay(replay_store, "r", RemoteBackend(server.url, retry=FAST))
    assert len(server.attempts) == 1


def test_a_client_error_is_not_retried(replay_store, stand_in_server):
    _record(replay_store, "r", 1)
    server = stand_in_server(_answer, failure=lambda body: (400, {}))
    with pytest.raises(BackendError, match="HTTP 400: "):
        replay(replay_store, "r", RemoteBackend(server.url, retry=FAST))
    assert len(server.attempts) == 1


def test_connect_errors_are_retried_until_the_attempts_run_out(replay_store):
    _record(replay_store, "r", 1)
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = RemoteBackend(f"http://127.0.0.1:{port}/v1",
                            retry=RetryPolicy(max_attempts=3, base_delay_s=0.001))
    with pytest.raises(BackendError, match=r"cannot reach .* after 3 attempts \(ConnectError "
                                           r"x2\)"):
        replay(replay_store, "r", backend)


def test_retry_after_reads_seconds_and_http_dates():
    now = 1_800_000_000.0
    later = format_datetime(datetime.fromtimestamp(now + 30, UTC), usegmt=True)
    earlier = format_datetime(datetime.fromtimestamp(now - 30, UTC), usegmt=True)
    assert retry_after_s("120", now=now) == 120.0
    assert retry_after_s(" 1.5 ", now=now) == 1.5
    assert retry_after_s(later, now=now) == pytest.approx(30.0)
    assert retry_after_s(earlier, now=now) == 0.0
    assert [retry_after_s(v, now=now) for v in (None, "", "soon", "nan")] == [None] * 4
    assert [s for s in (400, 404, 429, 500, 501, 502, 503, 504, 505)
            if is_retried_status(s)] == [429, 500, 502, 503, 504]


# -- choosing runs, bad input ---------------------------------------------------------------


def test_select_runs_reads_names_globs_and_every_run(six_runs):
    six_runs.run("empty")  # no steps: nothing to replay, left out of globs and every run
    _record(six_runs, "other", 1)
    assert select_runs(six_runs, ["eval-[0-2]", "other", "eval-1"]) == [
        "eval-0", "eval-1", "eval-2", "other"]
    assert select_runs(six_runs, every=True) == [*(f"eval-{i}" for i in range(6)), "other"]
    assert select_runs(six_runs, ["eval-2@1"]) == ["eval-2@1"]  # any step address
    assert select_runs(six_runs, ["e*"]) == [f"eval-{i}" for i in range(6)]


@pytest.mark.parametrize(("names", "options", "error", "says"), [
    (["nope"], {}, NotFoundError, "nope"),
    (["trial-*"], {}, UsageError, "no run with steps matches 'trial-*'"),
    (["eval-1"], {"every": True}, UsageError, "not both"),
    ([], {}, UsageError, "name at least one run"),
])
def test_select_runs_refuses_what_names_nothing(six_runs, names, options, error, says):
    with pytest.raises(error, match=says.replace("*", r"\*")):
        select_runs(six_runs, names, **options)


@pytest.mark.parametrize("concurrency", [0, -1, 1.5, True])
def test_replay_runs_refuses_a_concurrency_that_is_not_a_positive_whole_number(
    six_runs, stand_in_server, concurrency
):
    server = stand_in_server(_answer)
    with pytest.raises(UsageError, match="concurrency must be a whole number >= 1"):
        replay_runs(six_runs, ["eval-1"], RemoteBackend(server.url), concurrency=concurrency)
    assert server.attempts == []


def test_an_unknown_run_fails_before_any_request(six_runs, stand_in_server):
    server = stand_in_server(_answer)
    with pytest.raises(NotFoundError):
        replay_runs(six_runs, ["eval-1", "nope"], RemoteBackend(server.url), concurrency=2)
    assert server.attempts == []


def test_a_backend_that_answers_one_call_at_a_time_refuses_concurrency(six_runs, tiny_engine):
    from kvtrace.replay.local import LocalBackend

    with pytest.raises(UsageError, match="answers one call at a time"):
        replay_runs(six_runs, ["eval-1", "eval-2"], LocalBackend(tiny_engine, None),
                    concurrency=2)


# -- the CLI ----------------------------------------------------------------------------------


def _kv(capsys, *args):
    from kvtrace.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.fixture
def cli_store(tmp_path):
    from kvtrace import open_store

    url = f"sqlite:///{tmp_path / 's.db'}"
    with open_store(url) as store:
        for i, calls in enumerate([2, 3, 1]):
            _record(store, f"eval-{i}", calls)
        _record(store, "doomed", 2)
    return url


def test_cli_replays_a_glob_with_several_requests_in_flight_into_one_json_report(
    cli_store, capsys, stand_in_server
):
    server = stand_in_server(_answer, hold_first_until=2)
    code, out, err = _kv(capsys, "--store", cli_store, "replay", "eval-*", "--backend",
                         server.url, "--concurrency", "3", "--mode", "verify", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [r["run"] for r in data["runs"]] == ["eval-0", "eval-1", "eval-2"]
    assert [r["status"] for r in data["runs"]] == ["ok"] * 3
    assert [len(r["report"]["steps"]) for r in data["runs"]] == [2, 3, 1]
    assert data["concurrency"] == 3 and data["total"]["steps"] == 6
    assert data["total"]["matching_steps"] == 6
    assert server.held_first and server.max_in_flight >= 2


def test_cli_reports_a_failed_run_with_its_reason_and_exits_1(cli_store, capsys,
                                                              stand_in_server):
    server = stand_in_server(
        _answer, failure=lambda body: (503, {"Retry-After": "0"})
        if "doomed" in body["messages"][0]["content"] else None)
    code, out, err = _kv(capsys, "--store", cli_store, "replay", "--all", "--backend",
                         server.url, "--concurrency", "2", "--retries", "1")
    assert code == 1 and err == ""
    text = " ".join(out.split())  # Rich wraps long lines at the console's width
    assert "4 runs: 3 ok, 1 failed" in text
    assert text.count("no oracle bound") == 1  # one note for the runs sharing it
    assert (f"failed: doomed at @1: {server.url} answered HTTP 503, after 2 attempts (HTTP 503 "
            'x1): {"error": {"message": "stand-in failure"}}') in text
    code, out, _ = _kv(capsys, "--store", cli_store, "replay", "eval-0", "eval-2",
                       "--backend", server.url, "--json")
    assert code == 0 and [r["status"] for r in json.loads(out)["runs"]] == ["ok", "ok"]


@pytest.mark.parametrize(("args", "says"), [
    (["replay", "nope", "eval-0"], "nope"),
    (["replay", "trial-*"], "no run with steps matches 'trial-*'"),
    (["replay", "eval-*", "--concurrency", "0"], "--concurrency"),
    (["replay", "eval-0", "--all"], "not both"),
    (["replay"], "name a run to replay"),
    (["replay", "eval-*", "--to", "eval-0@1"], "--to stops one run"),
    (["replay", "eval-*", "--concurrency", "2"], "needs a remote --backend"),
    (["replay", "eval-0", "--retries", "2"], "--retries is for remote backends"),
])
def test_cli_bad_input_is_one_error_line_and_exit_2(cli_store, capsys, args, says):
    code, out, err = _kv(capsys, "--store", cli_store, *args)
    assert code == 2 and out == ""
    assert err.startswith("error:") and err.count("\n") == 1 and says in err


# -- through kvtrace serve ----------------------------------------------------------------------


def test_runs_through_kvtrace_serve_give_the_same_per_run_results_at_any_concurrency(
    replay_store, tiny_engine, local_backend_factory, kvtrace_serve, tmp_path
):
    for i, calls in enumerate([2, 3, 2]):
        _record(replay_store, f"run-{i}", calls, topic=f"subject {i}")
    reports = []
    for concurrency in (1, 3):
        server = kvtrace_serve(local_backend_factory(tiny_engine,
                                                     kv_dir=tmp_path / f"kv-{concurrency}"))
        with RemoteBackend(server.url, model=tiny_engine.name, tokenizer=tiny_engine) as remote:
            reports.append(replay_runs(replay_store, ["run-0", "run-1", "run-2"], remote,
                                       concurrency=concurrency, mode="verify"))
    serial, parallel = reports
    assert all(o.report is not None for o in parallel.runs)
    assert _per_run(parallel) == _per_run(serial)
    assert [[s.mismatch for s in o.report.steps] for o in parallel.runs] == [
        [s.mismatch for s in o.report.steps] for o in serial.runs]


def test_bench_multireplay_replays_every_run_at_each_concurrency(capsys):
    code, out, err = _kv(capsys, "bench", "multireplay", "--server", "slots", "--runs", "3",
                         "--calls", "2", "--concurrency", "1,2", "--latency-ms", "1", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert "stand-in" in data["server"] and data["ratio_of"] == "2 over 1"
    assert {level: (case["requests"], case["failed_runs"])
            for level, case in data["cases"].items()} == {"1": (6, 0), "2": (6, 0)}
