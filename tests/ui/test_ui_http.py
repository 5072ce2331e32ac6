"""The UI over HTTP on loopback, on both store backends: pages, escaping, actions, the guard."""

from __future__ import annotations

import html
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvtrace import open_store
from kvtrace.cli import main
from kvtrace.store import ModelCall
from tests.replay.conftest import ByteTokenizer
from tests.ui.served import BIDI, HOSTILE, record_hostile_runs

PAGES = ["/", "/run?name=main", "/run?name=fixed", "/step?at=main@1", "/step?at=main@2",
         "/step?at=main@3", "/step?at=main@4", "/diff?a=main&b=fixed", "/tail?name=main"]


def _state(store) -> tuple:
    """Everything an action could change: runs and heads, reflog, notes, pauses."""
    runs = [(r.name, r.head_id) for r in store.runs()]
    notes = [(n.id, n.text) for s in store.path("main") for n in store.notes(s.id)]
    return runs, [e.id for e in store.reflog()], notes, [store.is_paused(n) for n, _ in runs]


@pytest.mark.parametrize("path", PAGES)
def test_every_page_answers_with_recorded_content_escaped_and_inert(store, start_ui, path):
    record_hostile_runs(store)
    ui = start_ui(store, tokenizer=ByteTokenizer(), tokenizer_name="bytes")
    response = ui.client.get(path)
    assert response.status_code == 200
    text = response.text
    assert "pwned'</script>" not in text and "<img src=x" not in text
    assert "\u202e" not in text and "\u200b" not in text
    nonce = response.headers["content-security-policy"].split("'nonce-")[1].split("'")[0]
    scripts = text.count("<script")
    assert scripts == text.count(f'<script nonce="{nonce}">') and scripts <= 1
    if path in ("/step?at=main@4", "/tail?name=main"):
        assert html.escape(HOSTILE) in text or "&lt;/script&gt;" in text
        assert "rm\\u202e\\u200bfdp.exe" in text


def test_the_step_page_shows_messages_tool_calls_and_usage_bars(store, start_ui):
    record_hostile_runs(store)
    ui = start_ui(store, tokenizer=ByteTokenizer(), tokenizer_name="bytes")
    text = ui.client.get("/step?at=main@3").text
    assert "provider cache read: 64 of 80 prompt tokens" in text
    assert "oracle bound:" in text and 'class="reuse"' in text and 'class="cached"' in text
    assert "The answer is 391." in text and "calc" in text
    assert 'id="fork-form"' in text and 'name="field" value="response"' in text


def test_the_diff_page_parts_the_runs_at_the_first_differing_step(store, start_ui):
    record_hostile_runs(store)
    text = start_ui(store).client.get("/diff?a=main&b=fixed").text
    assert "they share 1 step (the last @1" in text and "first differing content at @2" in text
    assert '<span class="del">-391</span>' in text and '<span class="add">+392</span>' in text


@pytest.mark.parametrize("case", ["no token", "bad token", "cross-site", "other origin",
                                  "not a form"])
def test_a_cross_site_post_is_refused_with_403_and_changes_nothing(store, start_ui, case):
    record_hostile_runs(store)
    ui = start_ui(store)
    token = ui.token()
    form = {"run": "main", "to": "1", "csrf": token}
    headers = {}
    if case == "no token":
        del form["csrf"]
    elif case == "bad token":
        form["csrf"] = token[:-2] + "xx"
    elif case == "cross-site":
        headers["Sec-Fetch-Site"] = "cross-site"
    elif case == "other origin":
        headers["Origin"] = "http://evil.example"
    before = _state(store)
    for action in ("revert", "pause", "note", "undo"):
        if case == "not a form":
            response = ui.client.post(f"/action/{action}", json={**form, "at": "main@1",
                                                                  "text": "x"})
        else:
            response = ui.client.post(f"/action/{action}", data={**form, "at": "main@1",
                                                                  "text": "x"}, headers=headers)
        assert response.status_code == 403, (action, response.text[-200:])
        assert 'class="error"' in response.text
    assert _state(store) == before


def test_the_same_post_with_the_token_goes_through(store, start_ui):
    record_hostile_runs(store)
    ui = start_ui(store)
    response = ui.client.post("/action/revert", data={"run": "main", "to": "1",
                                                      "csrf": ui.token()},
                              headers={"Sec-Fetch-Site": "same-origin", "Origin": ui.base})
    assert response.status_code == 303
    assert store.head("main").depth == 1


def test_each_action_changes_the_store_as_its_api_call_does(store, start_ui):
    record_hostile_runs(store)
    ui = start_ui(store)
    token = ui.token()

    def post(action: str, **form: str) -> str:
        response = ui.client.post(f"/action/{action}", data={**form, "csrf": token})
        assert response.status_code == 303, response.text[-300:]
        return ui.client.get(response.headers["location"]).text

    page = post("note", at="main@1", text="look <here>", author="me", back="main@1")
    assert [n.text for n in store.notes("main@1")] == ["look <here>"]
    assert "note 1 added" in page or "added" in page
    post("pause", run="main")
    assert store.is_paused("main")
    post("resume", run="main")
    assert not store.is_paused("main")
    head = store.head("main").id
    post("revert", run="main", to="2")
    assert store.head("main").depth == 2
    post("undo", run="main")
    assert store.head("main").id == head
    page = post("fork", at="main@2", name="edited", field="result", value="1000",
                as_text="1")
    edited = store.head("edited")
    assert edited.content["result"] == "1000" and edited.parent_id == store.show("main@1").id
    assert "forked edited with an edited result" in page


def test_a_fork_of_an_anthropic_call_edits_its_response_in_its_own_shape(store, start_ui):
    from tests.apis.test_apis import ANSWER, _anthropic_call

    original = _anthropic_call(store.run("claude"))
    ui = start_ui(store)
    page = ui.client.get("/step?at=claude@1").text
    shown = html.unescape(page.split('id="edit-value">')[1].split("</textarea>")[0])
    value = json.loads(shown)
    assert value["content"] == ANSWER["content"]  # thinking and signatures as recorded
    value["content"][2]["text"] = "Checking twice."
    response = ui.client.post("/action/fork", data={
        "at": "claude@1", "name": "claude-edit", "field": "response", "as_text": "0",
        "value": json.dumps(value), "csrf": ui.token("/run?name=claude")})
    assert response.status_code == 303
    edited = ModelCall(store.head("claude-edit"))
    assert edited.native["response"]["content"][2]["text"] == "Checking twice."
    assert edited.native["response"]["content"][0] == ANSWER["content"][0]
    assert edited.response["content"] == "Checking twice."
    assert store.head("claude-edit").parent_id == original.parent_id


@pytest.mark.parametrize(("form", "message"), [
    ({"at": "main@1", "name": "x", "field": "response", "value": "{not json", "as_text": "0"},
     "value is not JSON"),
    ({"at": "main@2", "name": "x", "field": "nosuchfield", "value": "1", "as_text": "1"},
     "has no field"),
    ({"at": "main@2", "name": "", "field": "result", "value": "1", "as_text": "1"},
     "name is missing"),
    ({"at": "main@2", "name": "bad..name", "field": "result", "value": "1", "as_text": "1"},
     "bad..name"),
    ({"at": "main@2", "name": "main", "field": "result", "value": "1", "as_text": "1"},
     "main"),
])
def test_a_bad_fork_form_is_a_4xx_with_one_line_that_keeps_the_edit_and_changes_nothing(
        store, start_ui, form, message):
    record_hostile_runs(store)
    ui = start_ui(store)
    before = _state(store)
    response = ui.client.post("/action/fork", data={**form, "csrf": ui.token()})
    assert response.status_code in (400, 409)
    error = response.text.split('id="fork-error">')[1].split("</p>")[0]
    assert message in html.unescape(error) and "\n" not in error
    assert _state(store) == before
    # The step's page again, what was typed kept in the form: nothing is lost.
    assert 'id="fork-form"' in response.text
    assert f'<textarea name="value" id="edit-value">{html.escape(form["value"])}</textarea>' in (
        response.text)
    assert f'name="name" required size="30" value="{html.escape(form["name"])}"' in response.text


def test_a_request_for_another_host_name_is_refused(store, start_ui):
    """DNS rebinding: a page whose own name resolves to 127.0.0.1 reads nothing."""
    record_hostile_runs(store)
    ui = start_ui(store)
    assert ui.client.get("/", headers={"Host": "evil.example"}).status_code == 421
    assert ui.client.get("/", headers={"Host": f"localhost:{ui.server.port}"}).status_code == 200


def test_with_a_key_every_page_needs_it_and_the_login_form_sets_it(store, start_ui):
    record_hostile_runs(store)
    ui = start_ui(store, api_key="s3cret-key")
    refused = ui.client.get("/run?name=main")
    assert refused.status_code == 401 and 'action="/login"' in refused.text
    assert "main" not in refused.text.split("<body>")[1].replace("main@", "")
    assert ui.client.get("/events/runs").status_code == 401
    assert ui.client.post("/login", data={"api_key": "wrong"}).status_code == 401
    assert ui.client.get("/", headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
    response = ui.client.post("/login", data={"api_key": "s3cret-key"})
    assert response.status_code == 303
    assert ui.client.get("/run?name=main").status_code == 200  # the cookie


def test_unknown_runs_and_steps_are_404_pages(store, start_ui):
    record_hostile_runs(store)
    ui = start_ui(store)
    for path in ("/run?name=nosuch", "/step?at=main@99", "/tail?name=nosuch",
                 "/events/tail?name=nosuch", "/replay?id=7"):
        response = ui.client.get(path)
        assert response.status_code in (400, 404), path
        assert 'id="error"' in response.text


@pytest.mark.parametrize(("argv", "flag"), [
    (["ui", "--host", "0.0.0.0", "--no-tokens"], "--api-key"),
    (["ui", "--port", "70000", "--no-tokens"], "--port"),
    (["ui", "--api-key", "has space", "--no-tokens"], "--api-key"),
])
def test_cli_ui_bad_options_are_one_error_line(tmp_path, monkeypatch, capsys, argv, flag):
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    monkeypatch.delenv("KVTRACE_UI_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        main(["init"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1 and flag in err


def test_bidi_controls_in_a_tool_name_show_as_escapes(store, start_ui):
    store.run("main").record_tool_call(BIDI, {"path": "/"}, "\x1b]52;c;aGk=\x07 done")
    text = start_ui(store).client.get("/step?at=main@1").text
    assert "\x1b" not in text and "rm\\u202e\\u200bfdp.exe" in text


def test_cli_ui_serves_the_store_and_stops_on_ctrl_c_with_a_stream_open(tmp_path):
    url_of_store = f"sqlite:///{tmp_path / 'store.db'}"
    with open_store(url_of_store) as store:
        record_hostile_runs(store)
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtrace", "--store", url_of_store, "ui", "--port", "0",
         "--no-tokens", "--no-replay", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(4)]  # one indented JSON object
        while not lines[-1].startswith("}"):
            lines.append(process.stdout.readline())
        url = json.loads("".join(lines))["url"]
        assert url.startswith("http://127.0.0.1:")
        assert "main" in httpx.get(url).text
        with httpx.stream("GET", f"{url}events/tail?name=main", timeout=30) as stream:
            assert stream.status_code == 200
            started = time.monotonic()
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0
            assert time.monotonic() - started < 10  # the open stream did not hold it up
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


def test_a_huge_value_is_cut_on_the_step_page_with_the_way_to_the_whole(store, start_ui):
    from kvtrace.store.present.shown import MAX_SHOWN

    huge = "y" * (MAX_SHOWN * 10)
    store.run("main").record_tool_call("read_file", {"path": "/dump"}, huge)
    ui = start_ui(store)
    page = ui.client.get("/step?at=main")
    assert page.status_code == 200
    assert len(page.text) < 3 * MAX_SHOWN  # the page holds the cut value, not the 200,000
    assert f"{MAX_SHOWN * 9:,} more characters" in page.text
    assert "past what this page edits" in page.text and "<textarea" not in page.text
    link = html.unescape(page.text.split('id="whole-step"')[0].rsplit('href="', 1)[1])
    whole = ui.client.get(link.split('"')[0])
    assert whole.status_code == 200 and whole.json()["content"]["result"] == huge
    assert whole.headers["x-content-type-options"] == "nosniff"
    assert whole.headers["cache-control"] == "no-store"


def test_a_long_run_page_lists_and_draws_one_page_of_steps(store, start_ui):
    from kvtrace.ui.views import RUN_PAGE_STEPS

    run = store.run("long")
    num_steps = 2 * RUN_PAGE_STEPS + 10
    for i in range(num_steps):
        run.record_tool_call("calc", {"x": i}, i)
    ui = start_ui(store)
    head = ui.client.get("/run?name=long").text  # the last page: the head's
    assert f"page 3 of 3: steps {2 * RUN_PAGE_STEPS + 1} to {num_steps} of {num_steps}" in head
    assert head.count('href="/step?at=long%40') == num_steps - 2 * RUN_PAGE_STEPS
    first = ui.client.get("/run?name=long&page=1").text
    assert "@1 " in first and f"@{RUN_PAGE_STEPS + 1} " not in first
    height = int(first.split('<svg')[1].split('height="')[1].split('"')[0])
    assert height < 40 * RUN_PAGE_STEPS  # one page of rows tall, not the run's
    refused = ui.client.get("/run?name=long&page=4")
    assert refused.status_code == 400 and "pages 1 to 3" in refused.text
    runs = ui.client.get("/").text
    assert int(runs.split('<svg')[1].split('height="')[1].split('"')[0]) < 40 * RUN_PAGE_STEPS
    assert 'id="revert-form"' in head
    run.record_tool_call("calc", {"x": "more"}, 0)  # a page that holds only the head's step
    for i in range(RUN_PAGE_STEPS - 10):
        run.record_tool_call("calc", {"x": i}, i)
    last = ui.client.get("/run?name=long").text
    assert "page 4 of 4" in last and 'id="revert-form"' not in last


def test_the_diff_page_marks_an_edited_copy_and_wraps_long_strings(store, start_ui):
    run = store.run("main")
    for i in range(3):
        run.record_tool_call("calc", {"x": i}, "z" * 3000 if i == 2 else i)
    store.fork("main@3", "what-if", edit={"result": "short"})
    ui = start_ui(store)
    page = ui.client.get("/diff?a=main&b=what-if").text
    original = store.show("main@3").short_id
    assert f"edited copy of {original}" in page
    assert "minmax(0, 1fr)" in page and "overflow-wrap: anywhere" in page


def test_a_failed_fork_keeps_a_multi_line_edit_as_typed(store, start_ui):
    record_hostile_runs(store)
    ui = start_ui(store)
    typed = "line one\r\nline two"  # what a browser sends for a textarea's two lines
    response = ui.client.post("/action/fork", data={
        "at": "main@2", "name": "main", "field": "result", "value": typed, "as_text": "1",
        "csrf": ui.token()})
    assert response.status_code in (400, 409)
    kept = response.text.split('id="edit-value">')[1].split("</textarea>")[0]
    assert kept == "line one\nline two"  # no \x0d at the line's end: it forks as typed

