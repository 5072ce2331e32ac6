"""`--from RUN@K`: an unchanged agent answered from its recording up to step K, live after.

The agent is examples/fork_agent.py (ten openai-SDK calls, a tool that writes
a file), run as a separate process against a real server on loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtrace.errors import KvtraceError, UsageError
from kvtrace.store import ModelCall, StepKind

AGENT = Path(__file__).resolve().parents[2] / "examples" / "fork_agent.py"


def run_agent(url: str, folder: Path, *, model: str, calls: int = 10) -> list[str]:
    """Run the agent to its end against `url`; the notes its tool wrote."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": "sk-test"}
    subprocess.run([sys.executable, str(AGENT), "--calls", str(calls), "--model", model,
                    "--folder", str(folder)], env=env, check=True, timeout=600,
                   capture_output=True)
    return (folder / "notes.txt").read_text().splitlines()


def model_calls(store, run: str) -> list[Any]:
    return [s for s in store.path(run) if s.kind == StepKind.MODEL_CALL]


@pytest.fixture
def recorded(store, serve_local, tiny_engine, tmp_path) -> tuple[Any, list[str]]:
    """A ten-call run `base` of the agent, recorded through the local engine."""
    server = serve_local(store, run="base")
    notes = run_agent(server.url, tmp_path / "base", model=tiny_engine.name)
    server.stop()
    assert len(model_calls(store, "base")) == 10
    return store, notes


def test_the_first_k_calls_come_from_the_recording_and_the_rest_go_live_warm(
        recorded, serve_started, tiny_engine, tmp_path):
    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve.fromrun import warm

    store, base_notes = recorded
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine))
    warmed = warm(store, "base@6", backend)
    # A linear agent: its sixth call holds the five before it, so only that one is rebuilt.
    assert warmed == ModelCall(model_calls(store, "base")[5]).usage.prompt_tokens
    server = serve_started(backend=backend, store=store, run="fork", from_run="base@6")
    notes = run_agent(server.url, tmp_path / "fork", model=tiny_engine.name)
    summary = server.server.answerer.summary
    assert (summary.num_recorded, summary.num_served, summary.first_live_step) == (6, 6, 7)
    assert summary.parted is None
    base, fork = model_calls(store, "base"), model_calls(store, "fork")
    assert len(fork) == 10
    # The fork's first six steps are the parent's own, by id: nothing recorded twice.
    assert [s.id for s in fork[:6]] == [s.id for s in base[:6]]
    assert all(s.id not in {b.id for b in base} for s in fork[6:])
    # The live calls reused the warm prefix: the 7th prompt holds all of step 6's.
    first_live = ModelCall(fork[6]).usage
    assert first_live.cached_tokens is not None
    assert first_live.cached_tokens >= ModelCall(base[5]).usage.prompt_tokens
    # The agent acted on the recorded answers: its first six notes are the recording's.
    assert notes[:6] == base_notes[:6]


def test_an_edit_of_step_k_is_what_the_agent_acts_on(recorded, serve_started, tiny_engine,
                                                     tmp_path):
    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend

    store, base_notes = recorded
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine))
    edit = {"response": {"role": "assistant", "content": "The sea is calm today."}}
    server = serve_started(backend=backend, store=store, run="edited", from_run="base@3",
                           edit=edit)
    notes = run_agent(server.url, tmp_path / "edited", model=tiny_engine.name)
    summary = server.server.answerer.summary
    assert (summary.num_served, summary.edit_seen, summary.first_live_step) == (3, True, 4)
    assert notes[2] == "The sea is calm today." and notes[:2] == base_notes[:2]
    base, edited = model_calls(store, "base"), model_calls(store, "edited")
    assert [s.id for s in edited[:2]] == [s.id for s in base[:2]]
    assert ModelCall(edited[2]).edit_of == base[2].id
    assert ModelCall(edited[2]).response["content"] == "The sea is calm today."


def test_an_agent_that_parts_early_goes_live_where_it_parted(recorded, serve_started,
                                                            tiny_engine, tmp_path):
    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend

    store, _ = recorded
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine))
    server = serve_started(backend=backend, store=store, run="other", from_run="base@6")
    # Another model name: the first request already differs from the recording's.
    run_agent(server.url, tmp_path / "other", model="another-model", calls=3)
    summary = server.server.answerer.summary
    assert (summary.num_served, summary.first_live_step) == (0, 1)
    # Why, in words: the request field that differed, both values (issue 41, item 2).
    assert summary.parted.startswith("the first request differs from step ")
    assert "model" in summary.parted and "'another-model'" in summary.parted
    assert len(model_calls(store, "other")) == 3
    assert {s.id for s in store.path("other")}.isdisjoint({s.id for s in store.path("base")})
    # diff names it too, at the first step, where both runs have one.
    from kvtrace.store.present.compare import compare

    result = compare(store, "base", "other")
    assert result.position == 1 and result.step_a is not None and result.step_b is not None
    [change] = [c for c in result.changes if c.field == "request model"]
    assert (change.a, change.b) == (tiny_engine.name, "another-model")


def test_the_recorded_part_is_answered_through_an_upstream_too(
        recorded, serve_local, serve_started, tiny_engine, tmp_path):
    store, base_notes = recorded
    upstream = serve_local(None)  # a second kvtrace serve on loopback, recording nothing
    server = serve_started(upstream=upstream.url, store=store, run="via-upstream",
                           from_run="base@6")
    notes = run_agent(server.url, tmp_path / "up", model=tiny_engine.name)
    summary = server.server.answerer.summary
    assert (summary.num_served, summary.first_live_step) == (6, 7)
    fork = model_calls(store, "via-upstream")
    assert [s.id for s in fork[:6]] == [s.id for s in model_calls(store, "base")[:6]]
    assert len(fork) == 10 and notes[:6] == base_notes[:6]


@pytest.mark.parametrize(("options", "error"), [
    ({"from_run": "nope@3"}, KvtraceError),
    ({"from_run": "base@40"}, KvtraceError),
    ({"from_run": "base@3", "edit": {"colour": "red"}}, UsageError),
    ({"from_run": "base@3", "edit": {"response": {"role": "user", "content": "x"}}},
     UsageError),
    ({"from_run": "base@3", "run": "base"}, UsageError),  # the fork's name is taken
])
def test_bad_input_is_refused_before_anything_starts(recorded, tiny_engine, options, error):
    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve import make_server

    store, _ = recorded
    runs = {info.name: info.head_id for info in store.runs()}
    with pytest.raises(error):
        make_server(backend=LocalBackend(tiny_engine, KVCache(tiny_engine)), store=store,
                    **{"run": "fork", **options})
    assert {info.name: info.head_id for info in store.runs()} == runs


def test_record_from_on_the_command_line(tmp_path, monkeypatch, capfd, tiny_model_folder):
    """`kvtrace record --from RUN@K -- CMD` as a user runs it, bad input included."""
    from kvtrace import open_store
    from kvtrace.cli import main

    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)

    def kv(*argv: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exit_info:
            main(list(argv))
        return int(exit_info.value.code or 0), capfd.readouterr().err

    agent = [sys.executable, str(AGENT), "--calls", "4"]
    code, _ = kv("record", "--model", str(tiny_model_folder), "--run", "base", "--",
                 *agent, "--folder", str(tmp_path / "a"))
    assert code == 0
    code, err = kv("record", "--model", str(tiny_model_folder), "--from", "base@2", "--",
                   *agent, "--folder", str(tmp_path / "b"))
    assert code == 0, err
    assert "2 of 2 recorded calls answered from the recording, first live call at step 3" in err
    with open_store() as store:
        base, fork = model_calls(store, "base"), model_calls(store, "base-from-2")
        assert [s.id for s in fork[:2]] == [s.id for s in base[:2]] and len(fork) == 4
    edit = tmp_path / "edit.json"
    edit.write_text('{"colour": "red"}')
    for argv, message in [
        (["--from", "nope@2"], "nope"),
        (["--from", "base@9"], "base@9"),
        (["--edit", str(edit)], "--edit changes step K of --from RUN@K"),
        (["--from", "base@2", "--edit", str(edit)], "no field 'colour'"),
        (["--from", "base@2", "--edit", str(tmp_path / "missing.json")], "missing.json"),
    ]:
        code, err = kv("record", "--model", str(tiny_model_folder), *argv, "--", *agent)
        assert code == 2, err
        assert err.startswith("error:") and message in err and len(err.strip().splitlines()) == 1
    with open_store() as store:
        assert sorted(info.name for info in store.runs()) == ["base", "base-from-2"]
    # An agent that exits at once: nothing answered, nothing live, no fork made.
    code, err = kv("record", "--model", str(tiny_model_folder), "--from", "base@2", "--",
                   sys.executable, "-c", "pass")
    assert code == 0 and "0 of 2 recorded calls answered from the recording, no live call" in err


def test_a_hybrid_model_records_and_forks_an_unchanged_agent_warm(store, serve_started,
                                                                  tmp_path):
    """Jamba (Mamba + attention + experts): the agent recorded, then forked at step 6 with
    the recorded prefix warm: the first live call resumes at a block boundary past step 6's
    prompt (what a window or state model can resume at)."""
    from kvtrace.engine import default_model_dir, load_engine, open_cache
    from kvtrace.engine.families import write_family
    from kvtrace.paths import default_cache_dir
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve.fromrun import warm

    tokenizer_dir = default_model_dir(default_cache_dir())
    engine = load_engine(write_family("jamba", tmp_path / "jamba", tokenizer_dir=tokenizer_dir),
                         cache_dir=tmp_path / "cache")
    server = serve_started(backend=LocalBackend(engine, open_cache(engine)), store=store,
                           run="base")
    run_agent(server.url, tmp_path / "base", model=engine.name)
    server.stop()
    backend = LocalBackend(engine, open_cache(engine, disk_dir=tmp_path / "kv"))
    assert warm(store, "base@6", backend) > 0
    server = serve_started(backend=backend, store=store, run="fork", from_run="base@6")
    run_agent(server.url, tmp_path / "fork", model=engine.name)
    summary = server.server.answerer.summary
    assert (summary.num_recorded, summary.num_served, summary.first_live_step) == (6, 6, 7)
    base, fork = model_calls(store, "base"), model_calls(store, "fork")
    assert [s.id for s in fork[:6]] == [s.id for s in base[:6]]
    cached = ModelCall(fork[6]).usage.cached_tokens
    step6 = ModelCall(base[5]).usage.prompt_tokens
    assert cached is not None and cached % 64 == 0 and cached >= step6 - 63


def test_record_says_what_a_full_kv_disk_did_not_write(tmp_path, monkeypatch, capfd,
                                                         tiny_model_folder):
    """Issue 41, item 6: `record` (and `--from`) end with the blocks the disk tier could not
    write and why; `--json` carries them."""
    import json

    from kvtrace.cli import main
    from kvtrace.engine.faults import fallback_path
    from tests.mounts import fill, tmpfs

    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    agent = [sys.executable, str(AGENT), "--calls", "3"]
    with tmpfs(tmp_path / "cache", size="256k") as cache:
        monkeypatch.setenv("KVTRACE_CACHE", str(cache))
        fill(cache, leave=0)
        try:
            with pytest.raises(SystemExit) as exit_info:
                main(["record", "--model", str(tiny_model_folder), "--run", "base", "--",
                      *agent, "--folder", str(tmp_path / "a")])
            err = capfd.readouterr().err
            assert exit_info.value.code in (0, None), err
            line = next(x for x in err.splitlines() if "could not be written" in x)
            assert line.startswith("kvtrace record: ") and "No space left on device" in line
            with pytest.raises(SystemExit):
                main(["record", "--model", str(tiny_model_folder), "--from", "base@2", "--json",
                      "--", *agent, "--folder", str(tmp_path / "b")])
            out = capfd.readouterr().out
            faults = json.loads(out[out.index("{"):])["cache_faults"]
            assert faults["failed_writes"] >= 1 and faults["reasons"] == [
                "No space left on device"]
        finally:
            for kv in {Path(p).parent for p in cache.rglob("*")} | {cache / "kv"}:
                fallback_path(kv).unlink(missing_ok=True)


def test_record_says_what_the_disk_budget_evicted(tmp_path, monkeypatch, capfd,
                                                  tiny_model_folder):
    """Issue 41, item 6: a disk tier at its budget ends `record` with what it evicted."""
    import json

    from kvtrace.cli import main

    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVTRACE_KV_DISK_MAX", "1")  # one byte: every block written is evicted
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    agent = [sys.executable, str(AGENT), "--calls", "3"]
    with pytest.raises(SystemExit) as exit_info:
        main(["record", "--model", str(tiny_model_folder), "--run", "base", "--",
              *agent, "--folder", str(tmp_path / "a")])
    err = capfd.readouterr().err
    assert exit_info.value.code in (0, None), err
    line = next(x for x in err.splitlines() if "evicted" in x)
    assert line.startswith("kvtrace record: ") and "reached its budget of 1 B" in line
    with pytest.raises(SystemExit):
        main(["record", "--model", str(tiny_model_folder), "--from", "base@2", "--json", "--",
              *agent, "--folder", str(tmp_path / "b")])
    out = capfd.readouterr().out
    faults = json.loads(out[out.index("{"):])["cache_faults"]
    assert faults["evicted_blocks"] >= 1 and faults["disk_budget"] == 1
    assert not list((tmp_path / "cache" / "kv").rglob("*.safetensors"))


def test_recorded_calls_are_answered_while_the_model_is_still_loading(
        recorded, serve_started, tiny_engine, tmp_path):
    """The start overlaps the agent's (serve/loading.py): the recorded prefix needs no model,
    so the agent runs through it while the load has not ended; its first live call waits."""
    import threading
    import time

    import httpx

    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve import BackendLoad
    from kvtrace.serve.fromrun import warm

    store, base_notes = recorded
    may_load = threading.Event()

    def load() -> LocalBackend:
        may_load.wait(timeout=600)
        backend = LocalBackend(tiny_engine, KVCache(tiny_engine))
        warm(store, "base@6", backend)
        return backend

    server = serve_started(backend=BackendLoad(tiny_engine.name, load), store=store,
                           run="fork", from_run="base@6")
    env = {**os.environ, "OPENAI_BASE_URL": server.url, "OPENAI_API_KEY": "sk-test"}
    (tmp_path / "fork").mkdir()
    agent = subprocess.Popen([sys.executable, str(AGENT), "--calls", "10", "--model",
                              tiny_engine.name, "--folder", str(tmp_path / "fork")], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        prefix = server.server.answerer.prefixes[None]
        for _ in range(1200):  # the six recorded answers, with the model not loaded
            if prefix.summary.num_served == 6 or agent.poll() is not None:
                break
            time.sleep(0.05)
        assert prefix.summary.num_served == 6
        assert agent.poll() is None  # its seventh call waits for the model
        health = httpx.get(server.url.removesuffix("/v1") + "/health").json()
        assert health["loading"] is True and health["model"] == tiny_engine.name
        with pytest.raises(httpx.TimeoutException):  # ready means the model answers
            httpx.get(server.url + "/models", timeout=0.5)
    finally:
        may_load.set()
    assert agent.wait(timeout=600) == 0
    fork = model_calls(store, "fork")
    assert len(fork) == 10
    first_live = ModelCall(fork[6]).usage
    assert first_live.cached_tokens is not None
    assert first_live.cached_tokens >= ModelCall(model_calls(store, "base")[5]).usage.prompt_tokens
    assert (tmp_path / "fork" / "notes.txt").read_text().splitlines()[:6] == base_notes[:6]


def test_a_model_that_fails_to_load_answers_503_and_records_nothing(sqlite_store,
                                                                     serve_started):
    import httpx

    from kvtrace.errors import UnsupportedModelError
    from kvtrace.serve import BackendLoad
    from kvtrace.serve.loading import wait_loaded

    def load() -> Any:
        raise UnsupportedModelError("tiny-broken: layer 3 keeps a cache kvtrace cannot reuse")

    server = serve_started(backend=BackendLoad("tiny-broken", load), store=sqlite_store,
                           run="r")
    with pytest.raises(UnsupportedModelError, match="layer 3"):
        wait_loaded(server.server.answerer)
    reply = httpx.post(server.url + "/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "model_not_loaded"
    assert "tiny-broken did not load" in error["message"] and "layer 3" in error["message"]
    health = httpx.get(server.url.removesuffix("/v1") + "/health").json()
    assert health["loading"] is False and "layer 3" in health["error"]
    assert [run.name for run in sqlite_store.runs()] == []  # nothing was recorded


def test_warm_rebuilds_the_calls_no_later_call_continues(sqlite_store, tiny_engine):
    """A linear conversation's earlier calls are prefixes of its last: only the last is
    rebuilt (and a sub-agent's call, which the main thread does not continue, too)."""
    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve.fromrun import warm

    run = sqlite_store.run("threads")
    asked = [{"role": "system", "content": "You fix tests."},
             {"role": "user", "content": "Fix the failing test."}]
    first = {"role": "assistant", "content": "Looking at it."}
    run.record_model_call(asked, first, model="m")
    side = [{"role": "user", "content": "Sub-agent: list the test files."}]
    run.record_model_call(side, "tests/test_app.py", model="m")
    main_thread = [*asked, first, {"role": "user", "content": "Go on."}]
    run.record_model_call(main_thread, "Done.", model="m")
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine))
    warmed = warm(sqlite_store, "threads", backend)

    def prompt_tokens(messages: list[dict[str, str]]) -> int:
        return len(backend.tokenizer.chat_tokens(messages))

    assert warmed == prompt_tokens(side) + prompt_tokens(main_thread)


def test_a_fork_whose_model_fails_to_load_is_refused_at_its_first_live_call_and_not_made(
        recorded, serve_started, tiny_engine, tmp_path):
    import httpx

    from kvtrace.errors import UnsupportedModelError
    from kvtrace.serve import BackendLoad

    store, _ = recorded

    def load() -> Any:
        raise UnsupportedModelError("tiny-broken: layer 3 keeps a cache kvtrace cannot reuse")

    server = serve_started(backend=BackendLoad(tiny_engine.name, load), store=store,
                           run="fork", from_run="base@6")
    with pytest.raises(subprocess.CalledProcessError):  # its seventh call got a 503
        run_agent(server.url, tmp_path / "fork", model=tiny_engine.name)
    assert server.server.answerer.summary.num_served == 6
    assert "fork" not in [run.name for run in store.runs()]  # no fork of a failed start
    health = httpx.get(server.url.removesuffix("/v1") + "/health").json()
    assert health["status"] == "error" and "layer 3" in health["error"]


def held_load(engine: Any) -> tuple[Any, Any, list[Any]]:
    """A started `LoadingAnswerer` whose load (a real LocalAnswerer on `engine`) waits for the
    returned event; the list receives what it built."""
    import threading

    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend
    from kvtrace.serve.loading import LoadingAnswerer
    from kvtrace.serve.local import LocalAnswerer

    may_load = threading.Event()
    built: list[LocalAnswerer] = []

    def build() -> LocalAnswerer:
        may_load.wait(timeout=600)
        built.append(LocalAnswerer(LocalBackend(engine, KVCache(engine))))
        return built[0]

    loading = LoadingAnswerer(engine.name, build)
    loading.start()
    return loading, may_load, built


def test_a_server_told_to_stop_while_its_model_loads_does_not_wait_and_the_load_is_freed(
        tiny_engine):
    import asyncio

    from kvtrace.serve.loading import StoppedBeforeLoadError

    loading, may_load, built = held_load(tiny_engine)

    async def waiting_request_cancelled_then_closed() -> None:
        waiting = asyncio.create_task(loading.loaded())
        await asyncio.sleep(0.05)
        waiting.cancel()  # a client that left: the load the others wait for goes on
        with pytest.raises(asyncio.CancelledError):
            await waiting
        loading.abandon()  # serve's Ctrl-C: the process is about to end
        await asyncio.wait_for(loading.close(), timeout=5)  # no wait for the load

    asyncio.run(waiting_request_cancelled_then_closed())
    may_load.set()
    with pytest.raises(StoppedBeforeLoadError):
        loading.wait()
    assert loading.failure() is None  # stopped is not failed: record exits with its command's
    assert built and built[0]._preparer._shutdown  # what it loaded was freed


def test_a_server_that_stops_waits_for_a_load_under_way_and_frees_it(tiny_engine):
    """No loader is left running beside what the process builds next (folders.py's
    LOADING): `close` waits for it, then closes what it built."""
    import asyncio
    import threading

    loading, may_load, built = held_load(tiny_engine)
    threading.Timer(0.3, may_load.set).start()
    asyncio.run(asyncio.wait_for(loading.close(), timeout=60))
    assert built and built[0]._preparer._shutdown
    assert loading.wait() is built[0] and loading.failure() is None
