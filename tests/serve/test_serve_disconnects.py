"""Clients that leave, upstreams that hang, runs that are paused (issue 23, items 1, 5, 8).

Real servers on loopback ports, real stores on SQLite and PostgreSQL (the
`store` fixture), the tiny random model or the canned upstream of
tests/canned.py. An answer nobody received is never recorded as complete,
and work whose client left is stopped; a paused run is a 409 before any
work; a hung upstream is a 504 after `upstream_timeout`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest

LONG = 2000  # tokens: the tiny model decodes them in 15-40 s on the 2-core machines
QUESTION = [{"role": "user", "content": "Write a long story."}]
HANG = [{"role": "user", "content": "hang"}]


def health_of(server) -> dict:
    return httpx.get(server.url.removesuffix("/v1") + "/health", timeout=30).json()


def wait_until(condition: Callable[[], bool], *, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.05)


def engine_is_idle(server) -> bool:
    queue = health_of(server)["queue"]
    return queue["running"] == 0 and queue["waiting"] == 0


def recorded(store, run: str) -> bool:
    return any(info.name == run for info in store.runs()) and bool(store.path(run))


def give_up_after(url: str, body: dict, seconds: float) -> None:
    """Send `body` and leave (close the connection) after `seconds`, as a timed-out client."""
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/chat/completions", json=body, timeout=seconds)


# -- local mode: work whose client left is stopped and not recorded --------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_sdk_that_times_out_and_retries_leaves_no_step_and_no_work_behind(
    store, serve_local, tiny_engine, stream
):
    server = serve_local(store, run="gave-up")
    sdk = openai.OpenAI(base_url=server.url, api_key="x", timeout=1.5, max_retries=2)
    with pytest.raises(openai.APITimeoutError):
        sdk.chat.completions.create(model=tiny_engine.name, messages=QUESTION, max_tokens=LONG,
                                    stream=stream)
    # Three attempts, each abandoned at 1.5 s: each stopped at its next decode step, where
    # computing it in full would hold the engine for a minute or more.
    wait_until(lambda: engine_is_idle(server), seconds=20, what="the engine let the work go")
    assert health_of(server)["queue"]["cancelled"] == 3
    assert store.runs() == []  # nothing recorded: no answer was sent
    answered = httpx.post(f"{server.url}/chat/completions", timeout=60, json={
        "model": tiny_engine.name, "messages": QUESTION, "max_tokens": 2})
    assert answered.status_code == 200
    [step] = store.path("gave-up")
    assert step.meta["extra"]["http"]["complete"] is True


def test_clients_that_gave_up_do_not_hold_the_queue_against_new_ones(store, serve_local,
                                                                     tiny_engine):
    server = serve_local(store, run="queue", max_queue=2)
    body = {"model": tiny_engine.name, "messages": QUESTION, "max_tokens": LONG}
    leavers = [threading.Thread(target=give_up_after, args=(server.url, body, 0.5))
               for _ in range(3)]
    for leaver in leavers:
        leaver.start()
    for leaver in leavers:
        leaver.join()
    # 3 x 2,000 tokens would hold the engine for minutes; cancelled, it is free at once
    wait_until(lambda: engine_is_idle(server), seconds=20, what="the queue emptied")
    answered = httpx.post(f"{server.url}/chat/completions", timeout=60, json={
        **body, "max_tokens": 2})
    assert answered.status_code == 200
    assert health_of(server)["queue"]["cancelled"] == 3
    assert len(store.path("queue")) == 1


def test_a_stream_the_client_drops_after_its_first_bytes_is_recorded_once(
    store, serve_local, tiny_engine
):
    server = serve_local(store, run="dropped")
    body = {"model": tiny_engine.name, "messages": QUESTION, "max_tokens": 40, "stream": True}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=60) as reply:
        first = next(reply.iter_lines())
        assert first.startswith("data: ")
    wait_until(lambda: recorded(store, "dropped"), seconds=20,
               what="the dropped stream was recorded")
    time.sleep(0.3)  # a second write (the generator's end) would land meanwhile
    [step] = store.path("dropped")
    # a local answer is sent whole once generated, so all of it may have reached the socket
    # already: complete or not, as [DONE] was sent or not (the upstream tests below
    # pin complete: false on a stream that really broke off)
    assert step.meta["extra"]["http"]["stream"] is True


# -- upstream mode: the upstream request is closed with the client, or after a timeout -------


def test_an_upstream_request_whose_client_left_is_closed_and_not_recorded(
    store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(store, canned_upstream.url, run="left")
    give_up_after(proxy.url, {"model": "canned-model", "messages": HANG}, 1.0)
    wait_until(lambda: canned_upstream.abandoned == ["/v1/chat/completions"], seconds=10,
               what="the proxy closed its upstream request")
    canned_upstream.release.set()
    time.sleep(0.2)
    assert store.runs() == []


def test_a_hung_upstream_is_a_504_after_the_upstream_timeout_and_nothing_is_recorded(
    store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(store, canned_upstream.url, run="hung", upstream_timeout=0.5)
    started = time.monotonic()
    response = httpx.post(f"{proxy.url}/chat/completions", timeout=60,
                          json={"model": "canned-model", "messages": HANG})
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "upstream_timeout" and "--upstream-timeout" in error["message"]
    assert time.monotonic() - started < 10
    wait_until(lambda: canned_upstream.abandoned == ["/v1/chat/completions"], seconds=10,
               what="the proxy closed its upstream request")
    assert store.runs() == []


def test_a_stream_that_stalls_past_the_timeout_ends_with_an_error_event_and_is_recorded_incomplete(
    store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(store, canned_upstream.url, run="stalled", upstream_timeout=0.5)
    sdk = openai.OpenAI(base_url=proxy.url, api_key="x", max_retries=0)
    stream = sdk.chat.completions.create(model="canned-model", messages=HANG, stream=True)
    received = []
    with pytest.raises(openai.APIError, match=r"sent nothing for 0\.5 s"):
        for chunk in stream:
            received.append(chunk)
    assert len(received) == 2  # the two events the upstream sent before it stalled
    wait_until(lambda: recorded(store, "stalled"), seconds=10,
               what="the stalled stream was recorded")
    [step] = store.path("stalled")
    assert step.meta["extra"]["http"]["complete"] is False


def test_a_stream_whose_client_leaves_mid_way_closes_the_upstream_request(
    store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(store, canned_upstream.url, run="mid-way")
    body = {"model": "canned-model", "messages": HANG, "stream": True}
    with httpx.stream("POST", f"{proxy.url}/chat/completions", json=body, timeout=30) as reply:
        assert next(reply.iter_lines()).startswith("data: ")
    wait_until(lambda: canned_upstream.abandoned == ["/v1/chat/completions"], seconds=10,
               what="the proxy closed its upstream request")
    wait_until(lambda: recorded(store, "mid-way"), seconds=10,
               what="the dropped stream was recorded")
    [step] = store.path("mid-way")
    assert step.meta["extra"]["http"]["complete"] is False


def test_the_upstream_timeout_must_be_positive(canned_upstream):
    from kvtrace.errors import UsageError
    from kvtrace.serve import make_server

    for bad in (0, -1.0, float("nan")):
        with pytest.raises(UsageError, match="upstream_timeout"):
            make_server(upstream=canned_upstream.url, upstream_timeout=bad)


# -- paused runs: a 409 before any work -------------------------------------------------------


def test_a_request_to_a_paused_run_is_a_409_and_never_reaches_the_upstream(
    store, canned_upstream, serve_upstream
):
    proxy = serve_upstream(store, canned_upstream.url, run="watched")
    sdk = openai.OpenAI(base_url=proxy.url, api_key="x", max_retries=2)
    sdk.chat.completions.create(model="canned-model", messages=QUESTION)
    store.pause("watched", reason="a supervisor looks")
    calls = len(canned_upstream.seen)
    with pytest.raises(openai.ConflictError) as refused:
        sdk.chat.completions.create(model="canned-model", messages=QUESTION)
    assert refused.value.status_code == 409
    assert refused.value.body["code"] == "run_paused"
    assert len(canned_upstream.seen) == calls  # the SDK's retries included: never forwarded
    assert len(store.path("watched")) == 1
    store.resume("watched")
    sdk.chat.completions.create(model="canned-model", messages=QUESTION)
    assert len(store.path("watched")) == 2


def test_a_local_request_to_a_paused_run_is_a_409_before_the_engine_runs(
    store, serve_local, tiny_engine
):
    server = serve_local(store, run="main")
    body = {"model": tiny_engine.name, "messages": QUESTION, "max_tokens": 2}
    headers = {"X-Kvtrace-Run": "side"}
    assert httpx.post(f"{server.url}/chat/completions", json=body, headers=headers,
                      timeout=60).status_code == 200
    store.pause("side")
    refused = httpx.post(f"{server.url}/chat/completions", json=body, headers=headers, timeout=60)
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "run_paused"
    assert "nothing was computed" in refused.json()["error"]["message"]
    assert health_of(server)["queue"]["cancelled"] == 0
    other = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)  # run "main"
    assert other.status_code == 200
    assert len(store.path("side")) == 1 and len(store.path("main")) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_run_paused_while_its_answer_is_computed_gets_a_409_and_records_nothing(
    store, serve_local, tiny_engine, stream
):
    server = serve_local(store, run="paused-late")
    body = {"model": tiny_engine.name, "messages": QUESTION, "max_tokens": 2}
    assert httpx.post(f"{server.url}/chat/completions", json=body, timeout=60).status_code == 200
    results: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: results.append(httpx.post(
        f"{server.url}/chat/completions", json={**body, "max_tokens": 300, "stream": stream},
        timeout=300)))
    worker.start()
    wait_until(lambda: health_of(server)["queue"]["running"] == 1 or not worker.is_alive(),
               seconds=30, what="the engine started")
    store.pause("paused-late")
    worker.join()
    assert results[0].status_code == 409, results[0].text
    assert "neither recorded nor delivered" in results[0].json()["error"]["message"]
    assert len(store.path("paused-late")) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_run_paused_while_the_upstream_answers_records_nothing_and_the_client_is_told(
    store, canned_upstream, serve_upstream, stream
):
    proxy = serve_upstream(store, canned_upstream.url, run="paused-up")
    sdk = openai.OpenAI(base_url=proxy.url, api_key="x", max_retries=0)
    sdk.chat.completions.create(model="canned-model", messages=QUESTION)
    received = []

    def ask() -> None:  # the upstream holds its answer (after two events, streamed)
        answer = sdk.chat.completions.create(model="canned-model", messages=HANG, stream=stream)
        received.extend(answer if stream else [answer])

    errors: list[Exception] = []
    worker = threading.Thread(target=lambda: _catching(ask, errors))
    worker.start()
    wait_until(lambda: len(canned_upstream.seen) == 2, seconds=10, what="the request went on")
    time.sleep(0.3)  # a stream's first events reach the client
    store.pause("paused-up")
    canned_upstream.release.set()  # the upstream answers in full, now that the run is paused
    worker.join(timeout=30)
    [error] = errors
    # plain: a 409; a stream already under way: what arrives is passed on, but in place of
    # [DONE] an event holding the error, which the SDK raises; nothing recorded either way
    assert isinstance(error, openai.APIError) and "paused" in str(error), repr(error)
    if stream:
        assert len(received) >= 2
    else:
        assert isinstance(error, openai.ConflictError) and received == []
    time.sleep(0.2)
    assert len(store.path("paused-up")) == 1


def _catching(work: Callable[[], None], errors: list[Exception]) -> None:
    try:
        work()
    except Exception as exc:  # the test looks at it
        errors.append(exc)


# -- a cut answer is no answer (issue 41, item 1) ---------------------------------------------


def drop_mid_stream(store, canned_upstream, serve_upstream, run: str) -> None:
    """Record `run`: one streamed call whose client left after the first event."""
    proxy = serve_upstream(store, canned_upstream.url, run=run)
    body = {"model": "canned-model", "messages": HANG, "stream": True}
    with httpx.stream("POST", f"{proxy.url}/chat/completions", json=body, timeout=30) as reply:
        assert next(reply.iter_lines()).startswith("data: ")
    wait_until(lambda: recorded(store, run), seconds=10, what="the dropped stream was recorded")
    proxy.stop()


def test_a_cut_stream_is_never_served_from_the_recording_the_call_goes_live(
    store, canned_upstream, serve_upstream
):
    drop_mid_stream(store, canned_upstream, serve_upstream, "prox")
    canned_upstream.release.set()  # the live upstream answers in full now
    fork = serve_upstream(store, canned_upstream.url, run="again", from_run="prox@1")
    sdk = openai.OpenAI(base_url=fork.url, api_key="x", max_retries=0)
    chunks = list(sdk.chat.completions.create(model="canned-model", messages=HANG, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] is not None  # whole
    summary = fork.server.answerer.summary
    assert (summary.num_served, summary.first_live_step) == (0, 1)
    assert "cut before its end" in summary.parted
    [live] = store.path("again")
    assert live.meta["extra"]["http"]["complete"] is True
    assert live.id != store.path("prox")[0].id


def test_a_cut_stream_is_no_answer_for_the_replay_transport_either(
    store, canned_upstream, serve_upstream
):
    from kvtrace.tracer import ReplayTransport

    drop_mid_stream(store, canned_upstream, serve_upstream, "cut")
    body = {"model": "canned-model", "messages": HANG, "stream": True}
    transport = ReplayTransport(store.run("cut"), mode="none")
    with httpx.Client(transport=transport, base_url="http://recorded/v1") as client:
        reply = client.post("/chat/completions", json=body)
    assert reply.status_code == 404
    assert "cut before its end" in reply.json()["error"]["message"]


def test_a_cut_step_is_marked_where_people_look(store, store_url, canned_upstream,
                                                serve_upstream, capsys):
    from kvtrace.cli import main
    from kvtrace.store.present.summary import step_summary

    drop_mid_stream(store, canned_upstream, serve_upstream, "marked")
    [step] = store.path("marked")
    assert step_summary(step).startswith("[incomplete] ")  # log, diff, report, UI and MCP
    for argv, expected in ((["log", "marked"], "[incomplete]"),
                           (["show", "marked@1"], "incomplete: the client left")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--store", store_url, *argv])
        assert exit_info.value.code in (0, None)
        assert expected in capsys.readouterr().out


# -- a full store disk (issue 41, item 7) -----------------------------------------------------


def test_a_full_store_disk_is_one_507_that_sdks_do_not_retry_and_no_recompute_storm(
        tmp_path, canned_upstream, serve_upstream, caplog):
    from kvtrace import open_store
    from tests.mounts import fill, tmpfs

    with tmpfs(tmp_path / "disk", size="2m") as disk:
        store = open_store(f"sqlite:///{disk}/store.db")
        try:
            proxy = serve_upstream(store, canned_upstream.url, run="full")
            sdk = openai.OpenAI(base_url=proxy.url, api_key="x", max_retries=3)
            sdk.chat.completions.create(model="canned-model", messages=QUESTION)  # recorded
            fill(disk, leave=0)
            forwarded = len(canned_upstream.seen)
            with pytest.raises(openai.APIStatusError) as refused:
                sdk.chat.completions.create(model="canned-model",
                                            messages=[{"role": "user", "content": "Again?"}])
            assert refused.value.status_code == 507
            error = refused.value.body
            assert error["code"] == "store_full" and "store.db" in error["message"]
            assert "is full" in error["message"]
            assert len(canned_upstream.seen) == forwarded + 1  # the SDK did not retry it
            with pytest.raises(openai.APIStatusError):  # refused before any work now
                sdk.chat.completions.create(model="canned-model", messages=QUESTION)
            assert len(canned_upstream.seen) == forwarded + 1
            assert proxy.server.recording.unrecorded[0] == 1
            assert not any(r.exc_info for r in caplog.records)  # one line, no traceback
            assert len(store.path("full")) == 1
        finally:
            store.close()
