"""The HTML report: runs, their branch graph, steps, token bars and notes on one page.

    page = gather(store, ["main", "main-edit"], tokenizer)   # records (contents.py)
    html_text = render_html(page)                             # one self-contained page

The page needs no network: CSS and script are inline, and a Content
Security Policy forbids loading anything else. Every recorded value is
escaped before it is written: recorded content is untrusted.
"""

from __future__ import annotations

from kvtrace.page.contents import GraphNode, Page, PageRun, PageStep, Prompt, gather
from kvtrace.page.render import render_html, write_report

__all__ = [
    "GraphNode", "Page", "PageRun", "PageStep", "Prompt", "gather", "render_html", "write_report",
]
