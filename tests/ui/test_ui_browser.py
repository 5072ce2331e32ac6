"""The UI in headless Chromium (Debian's, installed by `make chromium`), driven by Playwright.

Every page loads with no console error and runs no recorded script; the
live tail shows a step another process appends; a fork made with the form
is in the store with its edit (and in `kvtrace runs`); a replay shows its
progress and per-step hit bars (a tiny random model); a form posted from
another origin is refused and changes nothing. Screenshots go to
tests/artifacts/.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvtrace import open_store
from kvtrace.cli import main
from tests.page.test_report import CHROMIUM_ARGS, _chromium
from tests.replay.conftest import ByteTokenizer
from tests.ui.served import record_hostile_runs

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
ROOT = Path(__file__).resolve().parent.parent.parent


class Browser:
    """A Chromium page that records console errors, page errors and dialogs as problems."""

    def __init__(self, browser: Any) -> None:
        self.problems: list[str] = []
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.on("console",
                     lambda m: self.problems.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda error: self.problems.append(str(error)))
        self.page.on("dialog", lambda dialog: self.problems.append(f"dialog {dialog.message}"))

    def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"ui-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture
def chromium() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    executable = _chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield Browser(browser)
        finally:
            browser.close()


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


def test_every_page_loads_without_errors_and_runs_no_recorded_script(sqlite_url, start_ui,
                                                                     chromium):
    store = open_store(sqlite_url)
    record_hostile_runs(store)
    ui = start_ui(store, tokenizer=ByteTokenizer(), tokenizer_name="bytes")
    page = chromium.page
    pages = {"runs": "/", "run": "/run?name=main", "step": "/step?at=main@4",
             "model-step": "/step?at=main@3", "diff": "/diff?a=main&b=fixed",
             "tail": "/tail?name=main"}
    for name, path in pages.items():
        page.goto(ui.base + path)
        page.wait_for_load_state("load")
        assert "pwned" not in page.title(), name
        chromium.shot(name)
    page.goto(ui.base + "/step?at=main@4")
    body = page.inner_text("#step-body")
    assert "</script><script>document.title = 'pwned'</script>" in body  # shown as text
    assert "rm\\u202e\\u200bfdp.exe" in body
    assert page.evaluate("document.querySelectorAll('#step-body img, #step-body script')"
                         ".length") == 0
    page.goto(ui.base + "/run?name=main")
    page.click("#graph svg a[href='#r0-s2'] circle")  # a graph node leads to its step's row
    assert page.evaluate("location.hash") == "#r0-s2"
    store.close()
    assert chromium.problems == []


def test_the_live_tail_shows_a_step_another_process_appends(store_urls, start_ui, chromium):
    url = store_urls()  # SQLite (polled) and PostgreSQL (LISTEN/NOTIFY)
    store = open_store(url)
    record_hostile_runs(store)
    ui = start_ui(store)
    page = chromium.page
    page.goto(ui.base + "/tail?name=main")
    page.wait_for_selector("#tail tr[data-step]")
    before = page.eval_on_selector_all("#tail tr[data-step]", "rows => rows.length")
    code = ("import sys; from kvtrace import open_store\n"
            "with open_store(sys.argv[1]) as s:\n"
            "    s.run('main').record_tool_call('lookup', {'q': 'x'}, 'from another <process>')\n")
    subprocess.run([sys.executable, "-c", code, url], check=True, cwd=ROOT,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    appended = store.head("main")
    page.wait_for_selector(f"#tail tr[data-step='{appended.id}']", timeout=10_000)
    assert page.eval_on_selector_all("#tail tr[data-step]", "rows => rows.length") == before + 1
    assert "from another <process>" in page.inner_text(f"#tail tr[data-step='{appended.id}']")
    store.pause("main")  # a move shows too
    page.wait_for_selector("#moves li", timeout=10_000)
    assert page.inner_text("#moves li").startswith("pause:")
    chromium.shot("tail")
    store.close()
    assert chromium.problems == []


def test_the_runs_page_shows_a_new_head_live(sqlite_url, start_ui, chromium):
    store = open_store(sqlite_url)
    record_hostile_runs(store)
    ui = start_ui(store)
    page = chromium.page
    page.goto(ui.base + "/")
    row = "#runs tr[data-run='fixed']"
    assert page.inner_text(f"{row} .depth") == "3"
    page.wait_for_timeout(500)  # the stream's first event (the heads as they are) has come
    store.run("fixed").record_note("one more")
    page.wait_for_selector(f"{row}.fresh", timeout=10_000)
    assert page.inner_text(f"{row} .depth") == "4"
    assert page.inner_text(f"{row} .head") == store.head("fixed").id[:12]
    store.close()
    assert chromium.problems == []


def test_a_fork_made_with_the_form_is_in_the_store_with_its_edit(sqlite_url, start_ui,
                                                                  chromium, capsys):
    store = open_store(sqlite_url)
    record_hostile_runs(store)
    ui = start_ui(store)
    page = chromium.page
    page.goto(ui.base + "/step?at=main@2")
    page.fill("#fork-form input[name=name]", "ui-fix")
    page.fill("#fork-form textarea", "392")
    page.click("#fork-form button[type=submit]")
    page.wait_for_selector("#flash")
    assert "forked ui-fix with an edited result" in page.inner_text("#flash")
    forked = store.head("ui-fix")
    assert forked.content["result"] == "392"
    assert forked.parent_id == store.show("main@1").id
    assert store.head("main").content["result"] != "392"  # the original is untouched
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--store", sqlite_url, "runs", "--json"])
    assert "ui-fix" in {run["name"] for run in json.loads(capsys.readouterr().out)}
    # a note, then pause from the run page
    page.fill("#note-form input[name=text]", "fixed the result")
    page.click("#note-form button[type=submit]")
    page.wait_for_selector("#flash")
    assert [n.text for n in store.notes("ui-fix@2")] == ["fixed the result"]
    page.goto(ui.base + "/run?name=main")
    page.click("#pause-form button")
    page.wait_for_selector("#resume-form")
    assert store.is_paused("main")
    store.close()
    assert chromium.problems == []


@pytest.mark.parametrize("mode", ["rebuild", "verify"])
def test_a_replay_shows_its_progress_and_a_hit_bar_per_model_call(sqlite_url, start_ui,
                                                                   chromium, tiny_model_factory,
                                                                   tmp_path, mode):
    from playwright.sync_api import expect

    from kvtrace.replay import open_local_backend

    folder = tiny_model_factory("ui-replay", 5)
    store = open_store(sqlite_url)
    record_hostile_runs(store)
    num_calls = sum(1 for s in store.path("main") if s.kind == "model_call")
    ui = start_ui(store, load_backend=lambda: open_local_backend(
        str(folder), cache_dir=tmp_path / "cache", kv_dir=tmp_path / "kv"))
    page = chromium.page
    page.goto(ui.base + "/run?name=main")
    page.select_option("#replay-form select[name=mode]", mode)
    page.click("#replay-form button")
    page.wait_for_selector("#replay-state")
    expect(page.locator("#replay-state")).to_have_text(re.compile("^done"), timeout=120_000)
    assert page.eval_on_selector_all("#hits tr.hit", "rows => rows.length") == num_calls
    assert page.evaluate("document.getElementById('progress').style.width") == "100%"
    widths = page.eval_on_selector_all("#hits .bar .reuse", "bars => bars.map(b => b.style.width)")
    assert widths[0] == "0%" and float(widths[1].rstrip("%")) > 0  # the 2nd call reuses the 1st
    chromium.shot(f"replay-{mode}")
    page.goto(ui.base + "/step?at=main@3")  # the step page shows what the replay computed
    assert "last replay (of main):" in page.inner_text("#usage")
    assert page.is_visible("#replay-bar")
    store.close()
    assert chromium.problems == []


def test_a_form_posted_from_another_origin_is_refused_and_changes_nothing(
        sqlite_url, start_ui, chromium, tmp_path):
    store = open_store(sqlite_url)
    record_hostile_runs(store)
    ui = start_ui(store)
    token = ui.token()  # even with the right token: the browser says the request is cross-site
    (tmp_path / "attack.html").write_text(
        f'<form id="f" method="post" action="{ui.base}/action/revert">'
        f'<input name="run" value="main"><input name="to" value="1">'
        f'<input name="csrf" value="{token}"></form>'
        "<script>document.getElementById('f').submit()</script>")
    handler = type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    attacker = ThreadingHTTPServer(("127.0.0.1", 0),
                                   lambda *a: handler(*a, directory=str(tmp_path)))
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    head = store.head("main").id
    try:
        with chromium.page.expect_response(lambda r: "/action/revert" in r.url) as answer:
            chromium.page.goto(f"http://127.0.0.1:{attacker.server_port}/attack.html")
        assert answer.value.status == 403
    finally:
        attacker.shutdown()
        attacker.server_close()
    assert store.head("main").id == head
    store.close()
