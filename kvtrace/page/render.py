"""The report as one self-contained HTML page (no network: inline CSS and script only).

Layout: a header (runs, store, tokenizer), the branch graph as inline SVG
(graph.py), then one section per run listing every step (steps.py). Every
recorded value is escaped and made inert (markup.py), and a
Content-Security-Policy meta tag forbids loading anything (style.py): a
recorded `<script>` is text on the page, never code. The page is written a
part at a time, each run's steps one part each: a long run's page is large.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from pathlib import Path

from kvtrace.page.contents import Page, gather
from kvtrace.page.graph import graph_section
from kvtrace.page.markup import escape, pre_block, when
from kvtrace.page.steps import message_html, run_section, step_bars, step_body
from kvtrace.page.style import CSP, SCRIPT, STYLE
from kvtrace.replay.backend import Tokenizer
from kvtrace.store import OnStep, Store

# What the live UI (kvtrace/ui) imports from here: one way to escape and draw the same records.
__all__ = ["STYLE", "escape", "graph_section", "message_html", "pre_block", "render_html",
           "step_bars", "step_body", "when", "write_report"]


def write_report(
    store: Store, runs: list[str], output: str | os.PathLike[str], *,
    tokenizer: Tokenizer | None = None, tokenizer_name: str | None = None,
    on_step: OnStep | None = None,
) -> Page:
    """Gather the report of `runs` and write it to `output` (atomically: temp file, rename).

    `on_step(done, total)` is told as each step of a run is read (a progress bar)."""
    page = gather(store, runs, tokenizer, tokenizer_name=tokenizer_name, on_step=on_step)
    path = Path(output)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as out:
            out.writelines(_document(page))  # a part at a time: a long run's page is large
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return page


def render_html(page: Page) -> str:
    """The page as one HTML document."""
    return "".join(_document(page))


def _document(page: Page) -> Iterator[str]:
    """The page's HTML in parts, each run's steps one part each."""
    names = ", ".join(page.lanes[: len(page.runs)])
    tokens = (f"tokens counted with the tokenizer of {escape(page.tokenizer)}" if page.tokenizer
              else "no token counts of kvtrace's own (no tokenizer)")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>kvtrace report: {escape(names)}</title>",
        f"<style>{STYLE}</style></head><body>",
        "<header><h1>kvtrace report</h1>",
        f'<p class="meta">runs: {escape(names)} · store: <code>{escape(page.store_url)}</code> · '
        f"{tokens} · written {escape(when(datetime.datetime.now(datetime.UTC).timestamp()))}</p>",
        '<p class="legend"><span><i class="dot" style="background:var(--reuse)"></i>reusable '
        '(oracle bound)</span><span><i class="dot" style="background:var(--compute)"></i>'
        'computed</span><span><i class="dot" style="background:var(--cached)"></i>provider '
        "cached (the black mark: the oracle bound's rate)</span></p>",
        '<p><button id="expand-all" type="button">expand all</button>'
        '<button id="collapse-all" type="button">collapse all</button></p></header>',
        graph_section(page),
    ]
    for part in parts:
        yield part + "\n"
    for index, run in enumerate(page.runs):
        yield from run_section(index, run)
        yield "\n"
    yield f"<script>{SCRIPT}</script>\n</body></html>\n"
