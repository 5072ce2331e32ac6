"""The HTML report: what it gathers (both backends), escaping, and the page in headless Chromium."""

from __future__ import annotations

import html
import shutil
from pathlib import Path

import pytest

from kvtrace import open_store
from kvtrace.cli import main
from kvtrace.page import gather, render_html, write_report
from tests.agent_runs import call, record_answer, record_calc_run
from tests.replay.conftest import ByteTokenizer

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
HOSTILE = "</pre><script>document.title = 'pwned'</script><img src=x onerror=alert(1)>"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def record_runs(store) -> None:
    """main (4 steps, a note), its fork `fixed` (edited tool result) and `probe` (not named)."""
    main_run = store.run("main")
    record_calc_run(main_run)
    main_run.record_tool_call("calc", {"expr": "<b>1/0</b>"}, HOSTILE, error="ZeroDivisionError")
    store.note("main@2", f"suspicious: {HOSTILE}", author="<supervisor>")
    record_answer(store.fork("main@1", "fixed"), "What is 17 * 23?", call("17 * 23"), "392")
    store.fork("main@3", "probe").record_note("looked here")


def test_the_report_gathers_every_step_tokens_notes_and_forks(store):
    record_runs(store)
    page = gather(store, ["main", "fixed"], ByteTokenizer(), tokenizer_name="bytes")
    main_run, fixed = page.runs
    assert [s.step.id for s in main_run.steps] == [s.id for s in store.path("main")]
    assert [s.step.id for s in fixed.steps] == [s.id for s in store.path("fixed")]
    assert fixed.steps[0].also_in == ["main"] and fixed.steps[1].also_in == []
    first, _, answer, _ = main_run.steps
    assert first.tokens.oracle_tokens == 0 < first.tokens.prompt_tokens
    assert 0 < answer.tokens.oracle_tokens < answer.tokens.prompt_tokens
    assert (answer.provider_prompt_tokens, answer.provider_cached_tokens) == (80, 64)
    assert main_run.steps[1].notes[0].author == "<supervisor>"
    assert ("fixed", 1) in main_run.forks and ("probe", 3) in main_run.forks
    assert page.lanes == ["main", "fixed", "probe"]
    assert len(page.nodes) == len({s.id for p in ("main", "fixed", "probe")
                                   for s in store.path(p)})


def test_recorded_content_is_escaped(store):
    record_runs(store)
    text = render_html(gather(store, ["main"]))
    assert HOSTILE not in text and html.escape(HOSTILE) in text
    assert text.count("<script>") == 1  # the page's own
    assert "&lt;supervisor&gt;" in text


def test_controls_and_bidi_characters_in_recorded_content_show_as_escapes(store):
    run = store.run("main")
    run.record_tool_call("rm\u202e\u200bfdp.exe", {"path": "/"}, "\x1b]52;c;aGk=\x07 done")
    text = render_html(gather(store, ["main"]))
    assert "\u202e" not in text and "\u200b" not in text and "\x1b" not in text
    assert "rm\\u202e\\u200bfdp.exe" in text and "\\x1b]52;c;aGk=\\x07 done" in text


def test_without_a_tokenizer_only_the_providers_cached_tokens_show(store):
    record_runs(store)
    page = gather(store, ["main"])
    assert page.tokenizer is None and all(s.tokens is None for s in page.runs[0].steps)
    assert 'class="cached"' in render_html(page) and 'class="reuse"' not in render_html(page)


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and Path("/usr/bin/chromium").exists():
        found = "/usr/bin/chromium"
    if found is None:
        pytest.skip("Debian's chromium is not installed (make test installs it with apt-get "
                    "where it can): the page cannot be rendered")
    return found


def test_the_page_opens_in_headless_chromium_without_errors_and_shows_every_step(tmp_path):
    from playwright.sync_api import sync_playwright

    executable = _chromium()
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with open_store(url) as store:
        record_runs(store)
        output = tmp_path / "report.html"
        write_report(store, ["main", "fixed"], output, tokenizer=ByteTokenizer(),
                     tokenizer_name="bytes")
        expected = [(name, step.id) for name in ("main", "fixed") for step in store.path(name)]
        edited = store.show("fixed@2").id
    problems: list[str] = []
    requests: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.on("dialog", lambda dialog: problems.append(f"dialog {dialog.message}"))
            page.on("request", lambda request: requests.append(request.url))
            page.goto(output.as_uri())
            assert page.title() == "kvtrace report: main, fixed"  # no recorded script ran
            for index, name in enumerate(("main", "fixed")):
                ids = page.eval_on_selector_all(
                    f"#run-{index} li.step", "items => items.map(i => i.dataset.step)")
                assert ids == [step_id for run, step_id in expected if run == name]
            assert page.is_visible(f"#run-1 li[data-step='{edited}'] summary")
            # a step's content shows on click; a graph node leads to its step, opened
            body = "#run-0 li.step:nth-child(2) .body"
            assert not page.is_visible(body)
            page.click("#run-0 li.step:nth-child(2) summary")
            page.wait_for_selector(body, state="visible", timeout=10_000)
            assert "suspicious:" in page.inner_text(body)
            assert HOSTILE in page.inner_text(body)  # shown as text
            page.click("#graph a[href='#r1-s2'] circle")
            page.wait_for_selector("#r1-s2 .body", state="visible", timeout=10_000)
            assert "392" in page.inner_text("#r1-s2 .body")
            page.click("#expand-all")
            shot = ARTIFACTS / "report.png"
            shot.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    print(f"screenshot of the report: {shot}")
    assert problems == []
    assert {url.split(":", 1)[0] for url in requests} == {"file"}  # nothing off the page
    assert shot.stat().st_size > 10_000


def test_cli_report_writes_the_page_with_the_models_tokenizer(tmp_path, monkeypatch, capsys):
    from kvtrace.engine import default_model_dir
    from kvtrace.paths import default_cache_dir

    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    with open_store() as store:
        record_runs(store)
    folder = default_model_dir(default_cache_dir())
    output = tmp_path / "report.html"
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "main", "fixed", "-o", str(output), "--model", str(folder)])
    assert exit_info.value.code in (0, None)
    assert capsys.readouterr().out.startswith(f"wrote {output}: 2 run(s), 7 steps")
    text = output.read_text()
    assert "oracle bound:" in text and 'class="reuse"' in text and folder.name in text


@pytest.mark.parametrize("argv", [
    ["report", "main", "nosuchrun", "-o", "{tmp}/r.html", "--no-tokens"],
    ["report", "main", "-o", "{tmp}/no/such/folder/r.html", "--no-tokens"],
    ["report", "main", "main", "-o", "{tmp}/r.html", "--no-tokens"],
    ["report", "main", "-o", "{tmp}/r.html", "--no-tokens", "--model", "x"],
])
def test_cli_report_bad_input_is_one_error_line_and_writes_nothing(tmp_path, monkeypatch, capsys,
                                                                   argv):
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    with open_store() as store:
        record_runs(store)
    with pytest.raises(SystemExit) as exit_info:
        main([arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_no_colour_means_two_things_in_the_report():
    """Issue 41, item 13: blue meant "provider cached" in the bars' legend and "model_call" in
    the graph's; each meaning has its own colour now."""
    import re

    from kvtrace.page.style import STYLE

    colours = dict(re.findall(r"--([a-z]+): (#[0-9a-f]{6})", STYLE.split("}")[0]))
    kinds = {colours[k] for k in ("model", "tool", "note", "other")}
    bars = {colours[k] for k in ("reuse", "compute", "cached", "rest")}
    assert len(kinds) == 4 and len(bars) == 4 and not kinds & bars


def test_unrelated_runs_get_rows_of_their_own_and_a_fork_shares_its_depth_s_line(store):
    """Issue 41, item 13: labels of unrelated runs shared one line, which ran past the box."""
    import re

    from kvtrace.page.graph import CHAR_PX, ROW, graph_section

    names = [f"experiment-{i}" for i in range(8)]
    for name in names:
        store.run(name).record_tool_call("lookup", {"city": f"City number {name}"},
                                         f"A long result for {name}, with several words")
    section = graph_section(gather(store, names, ByteTokenizer(), tokenizer_name="bytes"))
    lines = [html.unescape(re.sub(r"<[^>]+>", "", line))
             for line in re.findall(r"<text [^>]*>(.*?)</text>", section)]
    assert len(lines) == len(names) and not any(" | " in line for line in lines)
    assert sorted(int(y) for y in re.findall(r'<text x="\d+" y="(\d+)"', section)) == [
        14 + ROW * row + 4 for row in range(len(names))]
    width = int(re.search(r'<svg [^>]*width="(\d+)"', section).group(1))
    x = int(re.search(r'<text x="(\d+)"', section).group(1))
    assert width >= x + max(len(line) for line in lines) * CHAR_PX

    store.fork(f"{names[0]}@1", "related").record_tool_call("lookup", {"city": "B"}, "b")
    store.run(names[0]).record_tool_call("lookup", {"city": "A"}, "a")
    section = graph_section(gather(store, [names[0], "related"], ByteTokenizer(),
                                   tokenizer_name="bytes"))
    lines = re.findall(r"<text [^>]*>(.*?)</text>", section)
    assert len(lines) == 2 and " | " in lines[1]  # one tree: depth 2 holds both runs' steps
