"""`kvtrace serve` and `kvtrace record -- COMMAND` as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from kvtrace import open_store
from kvtrace.cli import main
from kvtrace.engine.numerics import native_bfloat16
from tests.canned import SECRET_KEY, all_blob_bytes

AGENT = textwrap.dedent("""
    import sys
    import openai

    client = openai.OpenAI(max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, max_tokens=3, messages=[{"role": "user", "content": "Weather in Paris?"}])
    stream = client.chat.completions.create(
        model=model, max_tokens=3, stream=True,
        messages=[{"role": "user", "content": "Weather in Paris?"}])
    print("chunks:", len(list(stream)))
    sys.exit(int(sys.argv[1]))
""")


THREE_APIS = textwrap.dedent("""
    import anthropic
    import openai

    question = [{"role": "user", "content": "Weather in Paris?"}]
    openai.OpenAI(max_retries=0).chat.completions.create(
        model="gpt-4o-mini", max_tokens=3, messages=question)
    message = anthropic.Anthropic(max_retries=0).messages.create(
        model="claude-haiku-4-5", max_tokens=3, messages=question)
    response = openai.OpenAI(max_retries=0).responses.create(
        model="gpt-4o-mini", max_output_tokens=3, input="Weather in Paris?")
    print("answered:", message.type, response.object)
""")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    for name in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY",
                 "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "three_apis.py").write_text(THREE_APIS)
    return tmp_path


def kv(capfd, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capfd.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_record_runs_the_command_against_the_local_engine_and_passes_its_exit_code(
    home, capfd, tiny_model_folder
):
    code, out, err = kv(capfd, "record", "--model", str(tiny_model_folder), "--run", "recorded",
                        "--", sys.executable, str(home / "agent.py"), "3")
    assert code == 3
    assert "chunks:" in out
    assert "recorded run 'recorded': 2 model calls" in err
    assert "cached" in err and "cached unknown" not in err
    with open_store() as store:
        steps = store.path("recorded")
        assert [s.kind for s in steps] == ["model_call", "model_call"]
        assert steps[1].meta["extra"]["http"]["stream"] is True


def test_record_points_the_openai_and_anthropic_sdks_at_its_server_and_says_the_model_rule(
    home, capfd, tiny_model_folder
):
    from kvtrace.apis import ProviderApi
    from kvtrace.store.kinds import ModelCall

    code, out, err = kv(capfd, "record", "--model", str(tiny_model_folder), "--run", "apis",
                        "--", sys.executable, str(home / "three_apis.py"))
    assert code == 0, err
    assert "answered: message response" in out
    assert err.count("every model name is answered by the local model") == 1
    assert "recorded run 'apis': 3 model calls" in err
    with open_store() as store:
        calls = [ModelCall(step) for step in store.path("apis")]
    assert [call.api for call in calls] == [ProviderApi.OPENAI_CHAT,
                                            ProviderApi.ANTHROPIC_MESSAGES,
                                            ProviderApi.OPENAI_RESPONSES]
    assert [call.request_model for call in calls] == ["gpt-4o-mini", "claude-haiku-4-5",
                                                      "gpt-4o-mini"]


def test_the_program_s_environment_keeps_the_user_s_keys_and_adds_placeholders_only():
    from kvtrace.serve.runner import client_env

    url = "http://127.0.0.1:5000/v1"
    bare = client_env({"PATH": "/bin"}, url)
    assert bare["OPENAI_BASE_URL"] == bare["OPENAI_API_BASE"] == url
    assert bare["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:5000"  # the SDK adds /v1/messages
    assert bare["OPENAI_API_KEY"] == bare["ANTHROPIC_API_KEY"] == "kvtrace"
    keyed = client_env({"OPENAI_API_KEY": "sk-o", "ANTHROPIC_API_KEY": "sk-a",
                        "ANTHROPIC_BASE_URL": "https://api.anthropic.com"}, url)
    assert (keyed["OPENAI_API_KEY"], keyed["ANTHROPIC_API_KEY"]) == ("sk-o", "sk-a")
    assert keyed["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:5000"
    token = client_env({"ANTHROPIC_AUTH_TOKEN": "tok"}, url)
    assert "ANTHROPIC_API_KEY" not in token  # it would shadow the user's token


def test_record_with_upstream_keeps_the_real_provider_and_names_a_new_run(
    home, capfd, canned_upstream, monkeypatch
):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET_KEY)
    code, _, err = kv(capfd, "record", "--upstream", canned_upstream.url, "--",
                      sys.executable, str(home / "agent.py"), "0")
    assert code == 0
    assert canned_upstream.seen[-1]["headers"]["authorization"] == f"Bearer {SECRET_KEY}"
    with open_store() as store:
        [run] = store.runs()
        assert run.name.startswith("record-") and f"'{run.name}'" in err
        assert run.depth == 2
        assert not any(SECRET_KEY.encode() in blob for blob in all_blob_bytes(store))
    assert "2 model calls, 82 prompt tokens (48 cached), 21 completion tokens" in err


def test_record_with_json_prints_what_it_recorded_after_the_commands_output(
    home, capfd, canned_upstream
):
    code, out, _ = kv(capfd, "record", "--upstream", canned_upstream.url, "--run", "agent",
                      "--json", "--", sys.executable, str(home / "agent.py"), "0")
    program, summary = out.split("\n", 1)
    assert code == 0 and program.startswith("chunks:")
    assert json.loads(summary) == {"run": "agent", "exit_code": 0, "runs": {"agent": {
        "calls": 2, "prompt_tokens": 82, "completion_tokens": 21, "cached_tokens": 48,
        "unknown_cached": 0, "other_steps": 0}}, "cache_faults": None, "unrecorded": 0}


@pytest.mark.parametrize(("argv", "message"), [
    (["record", "--upstream", "ftp://example.org", "--", "true"], "must start with http://"),
    (["record", "--run", "bad..name", "--upstream", "http://127.0.0.1:9/v1", "--", "true"],
     "invalid run name"),
    (["record", "--upstream", "http://127.0.0.1:9/v1", "--", "no-such-program-kvtrace"],
     "no such program"),
    (["serve", "--port", "70000", "--upstream", "http://127.0.0.1:9/v1"], "not a port"),
    (["serve", "--model", "m", "--upstream", "http://127.0.0.1:9/v1"], "--model is for local"),
    (["record", "--strict-model", "--upstream", "http://127.0.0.1:9/v1", "--", "true"],
     "--strict-model is for local mode"),
    (["serve", "--dtype", "bfloat16", "--upstream", "http://127.0.0.1:9/v1"],
     "--dtype is for local mode"),
    (["record", "--dtype", "int8", "--", "true"],
     "'int8' is not one of 'auto', 'float32', 'bfloat16'"),
])
def test_bad_options_print_one_error_line_and_exit_2(home, capfd, argv, message):
    code, _, err = kv(capfd, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and message in lines[-1]
    assert not any(line.startswith("error: ") for line in lines[:-1])


def test_serve_runs_until_interrupted_and_prints_what_it_recorded(home, canned_upstream):
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "serve", "--port", "0", "--run", "served",
         "--upstream", canned_upstream.url],
        stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert process.stderr is not None
        banner = process.stderr.readline()
        url = banner.split()[2]
        assert url.startswith("http://127.0.0.1:") and "run 'served'" in banner
        reply = httpx.post(f"{url}/chat/completions", json={
            "model": "canned-model", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        _, rest = process.communicate(timeout=60)
    assert "recorded run 'served': 1 model call" in rest
    with open_store() as store:
        assert store.show("served").kind == "model_call"


def test_serve_in_bfloat16_says_so_and_answers(home, tiny_model_folder):
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "serve", "--port", "0", "--run", "half",
         "--model", str(tiny_model_folder), "--dtype", "bfloat16"],
        stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert process.stderr is not None
        banner = process.stderr.readline()
        url = banner.split()[2]
        assert "local model" in banner  # at once: the model loads while the server answers
        said = []
        while not (line := process.stderr.readline()).startswith("kvtrace serve: loaded:"):
            assert line, "".join(said)  # the server ended before it said it loaded
            said.append(line)
        assert "bfloat16" in line
        # The one line saying it will be slow, when the CPU has no native bfloat16.
        assert any(x.startswith("warning: this CPU has no native bfloat16") for x in said) \
            is (native_bfloat16() is False)
        health = httpx.get(url.removesuffix("/v1") + "/health").json()
        assert health["dtype"] == "bfloat16"
        assert health["threads"].startswith(("up to ", "1, fixed"))  # engine/threads.py
        # the load's probes: run at this start, or kept from an earlier one (engine/memo.py)
        probes = health["probes"]
        assert "flash_rows" in probes["measured"] + probes["remembered"]
        reply = httpx.post(f"{url}/chat/completions", timeout=120, json={
            "model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    assert process.returncode == 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_model_loads_stops_serve_even_as_a_background_job(
        home, tiny_model_folder, signum):
    """Started as a shell starts a background job (SIGINT ignored), `serve` still stops on a
    signal that comes while its model loads, with the exit of a signal after the load."""
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "serve", "--port", "0", "--run", "early",
         "--model", str(tiny_model_folder)],
        stderr=subprocess.PIPE, text=True, env=dict(os.environ),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert process.stderr is not None
        url = process.stderr.readline().split()[2]
        health = httpx.get(url.removesuffix("/v1") + "/health").json()
        assert health["loading"] is True  # the signal comes during the load
        process.send_signal(signum)
        _, rest = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, rest  # stopped as after the load, not killed
    assert not any(line.startswith("kvtrace serve: loaded:") for line in rest.splitlines())


# -- authentication options (issue 23, item 7) -------------------------------------------------


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--api-key", ""], {}, "--api-key is empty"),
    (["--api-key", " "], {}, "--api-key must be visible ASCII"),
    (["--api-key", "two words"], {}, "without spaces"),
    ([], {"KVTRACE_SERVE_API_KEY": ""}, "$KVTRACE_SERVE_API_KEY is set but empty"),
    (["--host", "0.0.0.0"], {}, "--host 0.0.0.0 lets other machines reach the server"),
    (["--host", "example.org"], {}, "give --api-key"),
    (["--upstream-api-key", ""], {}, "--upstream-api-key is empty"),
    (["--upstream-timeout", "0"], {}, "--upstream-timeout must be > 0"),
], ids=["empty key", "blank key", "key with a space", "empty env key", "all interfaces",
        "a host name", "empty upstream key", "zero timeout"])
def test_unsafe_auth_and_timeout_options_are_refused_before_the_server_starts(
    home, capfd, monkeypatch, argv, env, message
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, err = kv(capfd, "serve", "--port", "0", "--upstream", "http://127.0.0.1:9/v1",
                      *argv)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and message in lines[-1], err
    assert not (home / "home").exists() or not any((home / "home").rglob("store.db-wal"))


def test_a_non_loopback_host_with_a_key_serves_and_only_health_and_the_schema_are_open(
    home, canned_upstream
):
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "serve", "--host", "0.0.0.0", "--port", "0",
         "--upstream", canned_upstream.url],
        stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, KVTRACE_SERVE_API_KEY="a-key-of-ours"))
    try:
        assert process.stderr is not None
        banner = process.stderr.readline()
        port = banner.split()[2].rsplit(":", 1)[1].split("/")[0]
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/openapi.json").status_code == 200  # documented as open
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": ""}).status_code == 401
        assert httpx.get(f"{base}/v1/models", headers={
            "Authorization": "Bearer a-key-of-ours"}).status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)


# -- kvtrace record and signals (issue 23, item 9) ---------------------------------------------

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    def leave(signum, frame):
        out.with_suffix(".signal").write_text(str(signum))
        sys.exit(7)
    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    out.write_text(str(os.getpid()))
    time.sleep(120)
""")


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_record_goes_on_to_its_command_which_is_waited_for(
    home, canned_upstream, signum
):
    (home / "child.py").write_text(CHILD)
    pid_file = home / "child.pid"
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "record", "--upstream", canned_upstream.url, "--",
         sys.executable, str(home / "child.py"), str(pid_file)],
        stderr=subprocess.PIPE, text=True, env=dict(os.environ), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert process.poll() is None and time.monotonic() < deadline, "no child started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert (home / "child.signal").read_text() == str(int(signum))  # the child got it
    assert not _is_running(child)  # and is gone: no orphan
    assert process.returncode == 7, err  # record exits with the child's own code
    assert "no model calls recorded" in err  # the summary still printed


def test_record_reports_a_command_killed_by_a_signal_as_128_plus_its_number(home, capfd,
                                                                            canned_upstream):
    code, _, _ = kv(capfd, "record", "--upstream", canned_upstream.url, "--",
                    sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert code == 128 + signal.SIGKILL


def test_record_exits_2_with_the_load_error_when_the_model_does_not_load(home, capfd):
    """The model loads while the command already runs (serve/loading.py): a folder that is no
    model it can load is found then; the command's live calls got a 503, record says why."""
    broken = home / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    asks = ("import os, httpx; r = httpx.post(os.environ['OPENAI_BASE_URL'] + "
            "'/chat/completions', timeout=120, json={'model': 'm', 'messages': "
            "[{'role': 'user', 'content': 'hi'}]}); "
            "print(r.status_code, r.json()['error']['code'])")
    code, out, err = kv(capfd, "record", "--model", str(broken), "--run", "r", "--",
                        sys.executable, "-c", asks)
    assert code == 2
    assert "503 model_not_loaded" in out  # what the command's call got
    assert err.strip().splitlines()[-1].startswith(f"error: cannot load the model in {broken}")
    with open_store() as store:
        assert [run.name for run in store.runs()] == []
