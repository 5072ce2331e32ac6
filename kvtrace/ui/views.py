"""The UI's pages as HTML strings, drawn from the same records as `kvtrace report`.

Each function takes what it shows (records gathered from the store by
`kvtrace.page.gather`, `kvtrace.store.present.compare`, a replay job's snapshot)
and returns HTML; nothing here reads the store. Recorded values go through
the report's `escape` (`kvtrace.inert`, then `html.escape`) and the report's
own drawing helpers (graph, token bars, step bodies). The pages that change
as one looks (the live tail, a replay) and their events are in live.py. Every form carries the
server's CSRF token (guard.py). The one script of a page runs under the
CSP nonce of its response: a recorded `<script>`, were it ever unescaped,
would still not run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kvtrace.errors import UsageError
from kvtrace.page.contents import Page, PageStep
from kvtrace.page.render import STYLE, escape, graph_section, step_bars, step_body, when
from kvtrace.replay import StepReport
from kvtrace.store import RunInfo, Step
from kvtrace.store.kinds import ModelCall, StepKind, ToolCall, edit_of
from kvtrace.store.present.compare import Comparison
from kvtrace.store.present.shown import MAX_SHOWN
from kvtrace.store.present.summary import step_summary
from kvtrace.ui.guard import CSRF_FIELD

UI_STYLE = """
nav { display: flex; gap: 16px; align-items: baseline; border-bottom: 1px solid #e1e4e8;
      padding-bottom: 8px; margin-bottom: 8px; }
nav .brand { font-weight: 700; }
table.list { border-collapse: collapse; width: 100%; background: #fff; }
table.list td, table.list th { border-bottom: 1px solid #eef0f2; padding: 4px 8px;
                               text-align: left; vertical-align: middle; }
table.list tr.fresh { background: #fff8d6; }
table.list td:nth-child(-n+2), .badge { white-space: nowrap; }
form.inline { display: inline-flex; gap: 6px; align-items: center; margin: 4px 8px 4px 0; }
form.block { margin: 8px 0; padding: 8px; border: 1px solid #e1e4e8; border-radius: 6px;
             background: #fff; }
textarea { width: 100%; min-height: 120px; font-family: ui-monospace, monospace; }
.flash { background: #e7f5ec; border: 1px solid #9fd3b1; padding: 4px 8px; border-radius: 4px; }
.error { background: #fdecea; border: 1px solid #f1a899; padding: 4px 8px; border-radius: 4px; }
.paused { color: #a1260d; font-weight: 600; }
.cols { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 12px; }
.cols td, .diff pre { overflow-wrap: anywhere; }
.diff pre { white-space: pre-wrap; }
.badge.edited { background: #fff1d6; }
.diff .add { background: #e6ffec; } .diff .del { background: #ffebe9; }
.diff .hunk { color: #6f42c1; }
.diff pre span { display: block; }
.progress { width: 100%; max-width: 480px; height: 14px; background: var(--rest);
            border-radius: 7px; overflow: hidden; }
.progress > span { display: block; height: 100%; background: var(--reuse); }
.bar .computed { background: var(--compute); }
"""

ERROR_TITLES = {400: "bad request", 401: "key needed", 403: "refused", 404: "not found",
                409: "conflict", 421: "wrong host"}
RUN_PAGE_STEPS = 200  # steps a run page lists and draws; a longer run is paged


@dataclass(frozen=True, slots=True)
class Frame:
    """What every page of one response shares: the CSRF token, the script nonce, a message."""

    csrf: str
    nonce: str
    flash: str | None = None


def document(frame: Frame, title: str, body: str, script: str = "") -> str:
    """A whole page: the report's style and the UI's, a nav bar, `body`, one nonce'd script."""
    flash = f'<p class="flash" id="flash">{escape(frame.flash)}</p>' if frame.flash else ""
    tag = f'<script nonce="{frame.nonce}">{script}</script>' if script else ""
    return ("<!DOCTYPE html>\n"
            '<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{STYLE}{UI_STYLE}</style></head><body>"
            '<nav><span class="brand">kvtrace ui</span><a href="/">runs</a></nav>'
            f"{flash}{body}{tag}</body></html>\n")


def error_page(frame: Frame, status: int, message: str) -> str:
    title = ERROR_TITLES.get(status, "error")
    return document(frame, f"kvtrace ui: {title}",
                    f'<h1>{escape(title)}</h1><p class="error" id="error">{escape(message)}</p>')


def login_page(frame: Frame, message: str) -> str:
    body = (f'<h1>key needed</h1><p class="error" id="error">{escape(message)}</p>'
            '<form class="block" method="post" action="/login">'
            '<label>key <input type="password" name="api_key" autocomplete="off"></label> '
            '<button type="submit">log in</button></form>')
    return document(frame, "kvtrace ui: key needed", body)


def link(path: str, **query: str) -> str:
    """A URL of this UI, its query values percent-encoded (run names may hold '/')."""
    return path + ("?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items())
                   if query else "")


def _form(frame: Frame, action: str, fields: dict[str, str], inner: str, *,
          css: str = "inline", ident: str | None = None) -> str:
    hidden = "".join(f'<input type="hidden" name="{escape(k)}" value="{escape(v)}">'
                     for k, v in {CSRF_FIELD: frame.csrf, **fields}.items())
    ident_attr = f' id="{ident}"' if ident else ""
    return (f'<form class="{css}"{ident_attr} method="post" action="{action}">'
            f"{hidden}{inner}</form>")


# -- the runs ------------------------------------------------------------------------------


def runs_page(frame: Frame, runs: list[RunInfo], paused: set[str], page: Page | None) -> str:
    rows = "".join(_run_row(run, run.name in paused) for run in runs)
    options = "".join(f'<option value="{escape(r.name)}">{escape(r.name)}</option>'
                      for r in runs)
    diff = ('<form class="inline" method="get" action="/diff" id="diff-form">'
            f'<label>compare <select name="a">{options}</select></label>'
            f'<label>with <select name="b">{options}</select></label>'
            '<button type="submit">side by side</button></form>') if len(runs) > 1 else ""
    graph = ""
    if page is not None and page.nodes:  # the latest RUN_PAGE_STEPS depths of the drawn runs
        deepest = max(node.depth for node in page.nodes)
        graph = graph_section(page, range(max(1, deepest - RUN_PAGE_STEPS + 1), deepest + 1))
    body = (f"<h1>runs</h1><p class=\"meta\">{len(runs)} runs · heads update live</p>"
            '<table class="list" id="runs"><thead><tr><th>run</th><th>steps</th>'
            "<th>head</th><th>state</th><th></th></tr></thead>"
            f"<tbody>{rows or '<tr><td colspan=5>no runs yet</td></tr>'}</tbody></table>"
            f"{diff}{graph}")
    return document(frame, "kvtrace ui: runs", body, _RUNS_SCRIPT)


def _run_row(run: RunInfo, is_paused: bool) -> str:
    head = run.head_id[:12] if run.head_id else "(empty)"
    page = escape(link("/run", name=run.name))
    return (f'<tr data-run="{escape(run.name)}"><td><a href="{page}">'
            f"{escape(run.name)}</a></td><td class=\"depth\">{run.depth}</td>"
            f'<td class="head mono">{escape(head)}</td>'
            f'<td class="state">{"<span class=paused>paused</span>" if is_paused else ""}</td>'
            f'<td><a href="{escape(link("/tail", name=run.name))}">live tail</a></td></tr>')


_RUNS_SCRIPT = """
(function () {
  var source = new EventSource("/events/runs");
  source.addEventListener("heads", function (event) {
    var data = JSON.parse(event.data);
    data.runs.forEach(function (run) {
      var row = null;
      document.querySelectorAll("#runs tr[data-run]").forEach(function (r) {
        if (r.dataset.run === run.name) { row = r; }
      });
      if (!row) { return; }
      var depth = row.querySelector(".depth"), head = row.querySelector(".head");
      if (depth.textContent !== String(run.depth)) { row.classList.add("fresh"); }
      depth.textContent = String(run.depth);
      head.textContent = run.head;
      row.querySelector(".state").textContent = run.paused ? "paused" : "";
    });
  });
})();
"""


# -- one run -------------------------------------------------------------------------------


def run_page(frame: Frame, name: str, page: Page, is_paused: bool, num_moves: int,
             number: int | None = None) -> str:
    """Run `name`'s page: its actions, and page `number` of its steps (RUN_PAGE_STEPS each,
    from step 1; None: the last, which holds the head), drawn and listed."""
    run = page.runs[0]
    all_steps = run.steps
    last = max(1, -(-len(all_steps) // RUN_PAGE_STEPS))
    number = last if number is None else number
    if not 1 <= number <= last:
        raise UsageError(f"page {number} of run {name!r}: it has pages 1 to {last}")
    depths = range((number - 1) * RUN_PAGE_STEPS + 1, number * RUN_PAGE_STEPS + 1)
    steps = [s for s in all_steps if s.step.depth in depths]
    pause = (_form(frame, "/action/resume", {"run": name}, '<button type="submit">resume'
                   "</button>", ident="resume-form") if is_paused else
             _form(frame, "/action/pause", {"run": name}, '<button type="submit">pause</button>',
                   ident="pause-form"))
    undo = (_form(frame, "/action/undo", {"run": name}, '<button type="submit">undo last move'
                  "</button>", ident="undo-form") if num_moves else "")
    revert = ""
    options = "".join(f'<option value="{s.step.depth}">@{s.step.depth} '
                      f"{escape(s.step.kind)}</option>" for s in steps
                      if s.step.depth < len(all_steps))
    if options:  # the earlier steps of this page (a page holding only the head has none)
        revert = _form(frame, "/action/revert", {"run": name},
                       f'<label>revert to <select name="to">{options}</select></label>'
                       '<button type="submit">revert</button>', ident="revert-form")
    replay = _form(frame, "/action/replay", {"run": name},
                   '<label>replay <select name="mode"><option value="rebuild">rebuild</option>'
                   '<option value="verify">verify</option></select></label>'
                   '<button type="submit">start</button>', ident="replay-form")
    state = '<span class="paused">paused</span> · ' if is_paused else ""
    rows = "".join(step_row(name, item) for item in steps)
    pages = _pager(name, number, last, depths, len(all_steps))
    body = (f"<h1>run <code>{escape(name)}</code></h1>"
            f'<p class="meta">{state}{len(all_steps)} steps · '
            f'<a href="{escape(link("/tail", name=name))}">live tail</a></p>'
            f'<div class="actions">{pause}{undo}{revert}{replay}</div>{pages}'
            f"{graph_section(page, depths)}"
            + (f'<p class="problem">no oracle bound: {escape(run.token_problem)}</p>'
               if run.token_problem else "")
            + '<h2>steps</h2><table class="list" id="steps"><tbody>'
            f"{rows or '<tr><td>no steps yet</td></tr>'}</tbody></table>")
    return document(frame, f"kvtrace ui: {name}", body)


def _pager(name: str, number: int, last: int, depths: range, num_steps: int) -> str:
    """Where this page of a long run's steps is, with links to the others (none: one page)."""
    if last == 1:
        return ""

    def to(page: int, label: str) -> str:
        return f'<a href="{escape(link("/run", name=name, page=str(page)))}">{label}</a>'

    around = [to(1, "first")] if number > 1 else []
    around += [to(number - 1, "earlier")] if number > 1 else []
    around += [to(number + 1, "later")] if number < last else []
    around += [to(last, "last (the head)")] if number < last else []
    shown = f"steps {depths.start} to {min(depths.stop - 1, num_steps)} of {num_steps}"
    return (f'<p class="meta" id="pager">page {number} of {last}: {shown} · '
            f"{' · '.join(around)}</p>")


def step_row(run: str, item: PageStep) -> str:
    """One step of a run as a table row (also what the live tail appends)."""
    step = item.step
    notes = (f'<span class="badge">{len(item.notes)} note{"s" if len(item.notes) > 1 else ""}'
             "</span>" if item.notes else "")
    copied = edit_of(step)
    if copied is not None:  # a fork's edited head: marked wherever it is listed, as in the CLI
        notes += f'<span class="badge edited">edited copy of {escape(copied[:12])}</span>'
    address = f"{run}@{step.depth}"
    return (f'<tr id="r0-s{step.depth}" data-step="{escape(step.id)}">'
            f'<td class="mono">@{step.depth}</td><td><i class="dot kind-{_kind(step.kind)}"></i>'
            f'{escape(step.kind)}</td><td><a href="{escape(link("/step", at=address))}">'
            f"{escape(item.summary)}</a></td><td>{step_bars(item)}</td><td>{notes}</td></tr>")


def plain_item(step: Step) -> PageStep:
    """A step as a PageStep with no token analysis (what the live tail shows of a new step)."""
    usage = ModelCall(step).usage if step.kind == StepKind.MODEL_CALL else None
    return PageStep(step, step_summary(step), [], f"r0-s{step.depth}", None,
                    usage.prompt_tokens if usage else None,
                    usage.cached_tokens if usage else None, [])


def _kind(kind: str) -> str:
    return kind if kind in (StepKind.MODEL_CALL, StepKind.TOOL_CALL, StepKind.NOTE) else "other"


# -- one step ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Draft:
    """What a fork that failed was sent, shown again under its error: nothing typed is lost."""

    name: str
    value: str
    error: str


def step_page(frame: Frame, address: str, run: str | None, item: PageStep,
              previous: PageStep | None, replayed: tuple[str, StepReport] | None,
              draft: Draft | None = None) -> str:
    step = item.step
    usage = _usage_section(item, replayed)
    actions = [_form(frame, "/action/note", {"at": step.id, "back": address},
                     '<label>note <input name="text" size="50" required></label>'
                     '<label>by <input name="author" size="12"></label>'
                     '<button type="submit">add note</button>', ident="note-form")]
    edit = _edit_field(step)
    if edit is not None and len(edit[1]) > MAX_SHOWN:
        actions.append(f'<p class="meta" id="fork-form">the {escape(edit[0])} is '
                       f"{len(edit[1]):,} characters, past what this page edits "
                       f"({MAX_SHOWN:,}): fork with an edit from the CLI (kvtrace fork "
                       f"{escape(step.short_id)} NEW --edit FILE)</p>")
    elif edit is not None:
        field_name, value, is_text = edit
        name = ""
        failed = ""
        if draft is not None:
            name, value = draft.name, draft.value
            failed = (f'<p class="error" id="fork-error">fork failed: {escape(draft.error)} '
                      "(your edit is kept below: fix it and fork again)</p>")
        actions.append(_form(
            frame, "/action/fork", {"at": step.id, "field": field_name,
                                    "as_text": "1" if is_text else "0"},
            f"<h4>fork with an edited {escape(field_name)}</h4>{failed}"
            f'<label>new run <input name="name" required size="30" value="{escape(name)}">'
            "</label>"
            f'<textarea name="value" id="edit-value">{escape(value)}</textarea>'
            + ("" if is_text else "<p class=\"meta\">JSON</p>")
            + '<button type="submit">fork</button>', css="block", ident="fork-form"))
    if run is not None:
        actions.append(_form(frame, "/action/revert", {"run": run, "to": step.id},
                             f'<button type="submit">revert {escape(run)} to here</button>',
                             ident="revert-here-form"))
    where = (f'of run <a href="{escape(link("/run", name=run))}">{escape(run)}</a>'
             if run else "")
    whole = escape(link("/step.json", at=step.id))
    body = (f'<h1>step <code>{escape(address)}</code></h1><p class="meta">{escape(step.kind)} '
            f"{where} · {escape(step.short_id)} · {escape(when(step.recorded_at))} · "
            f'<a href="{whole}" id="whole-step">whole step (JSON)</a></p>'
            f"{usage}<div class=\"actions\">{''.join(actions)}</div>"
            f'<div class="body" id="step-body">{step_body(item, previous)}</div>')
    return document(frame, f"kvtrace ui: {address}", body)


def _edit_field(step: Step) -> tuple[str, str, bool] | None:
    """The field a fork edits here (a tool's result, a model's response), its text, is it text.

    A response is shown in its call's own API shape (Anthropic content blocks,
    Responses output items): that is the shape an edit of it is read in.
    """
    value: Any
    if step.kind == StepKind.TOOL_CALL:
        name, value = "result", ToolCall(step).result
    elif step.kind == StepKind.MODEL_CALL:
        name, value = "response", ModelCall(step).native.get("response")
    else:
        return None
    if isinstance(value, str):
        return name, value, True
    return name, json.dumps(value, indent=2, ensure_ascii=False), False


def _usage_section(item: PageStep, replayed: tuple[str, StepReport] | None) -> str:
    if item.step.kind != StepKind.MODEL_CALL:
        return ""
    lines = []
    cached, prompt = item.provider_cached_tokens, item.provider_prompt_tokens
    lines.append(f"provider cache read: {cached} of {prompt} prompt tokens" if cached is not None
                 else "provider cache read: not reported (unknown, not 0)")
    tokens = item.tokens
    lines.append(f"oracle bound: {tokens.oracle_tokens} of {tokens.prompt_tokens} prompt tokens "
                 "reusable" if tokens else "oracle bound: no tokenizer")
    replay_bar = ""
    if replayed is not None:
        run, report = replayed
        lines.append(f"last replay (of {run}): {report.computed_tokens} of "
                     f"{report.prompt_tokens} prompt tokens computed, {report.reused_tokens} "
                     "reused")
        replay_bar = _replay_bar(report)
    else:
        lines.append("last replay: none of this step since the UI started")
    items = "".join(f"<li>{escape(line)}</li>" for line in lines)
    return (f'<section id="usage"><h2>usage</h2>{step_bars(item)}{replay_bar}'
            f"<ul>{items}</ul></section>")


def _replay_bar(report: StepReport) -> str:
    if not report.prompt_tokens or report.computed_tokens is None:
        return ""
    computed = 100 * report.computed_tokens / report.prompt_tokens
    return (f'<span class="bars"><span class="bar" id="replay-bar" title="computed in the last '
            f'replay"><span class="reuse" style="width:{100 - computed:.2f}%"></span>'
            f'<span class="computed" style="width:{computed:.2f}%"></span></span></span>')


# -- two runs side by side -----------------------------------------------------------------


def diff_page(frame: Frame, comparison: Comparison, path_a: list[Step],
              path_b: list[Step]) -> str:
    a, b = comparison.a, comparison.b
    common = comparison.divergence.common
    start = common.depth if common else 0
    parted = (f"they share {start} step{'' if start == 1 else 's'} (the last @{start}, "
              f"{common.short_id})"
              if common else "no common step: aligned from the root")
    first = (f"first differing content at @{comparison.position}" if comparison.position
             else "the same content throughout")
    columns = "".join(
        f'<div class="col" id="col-{side}"><h2><a href="{escape(link("/run", name=name))}">'
        f"{escape(name)}</a></h2>{_side(name, path[start:])}</div>"
        for side, name, path in (("a", a, path_a), ("b", b, path_b)))
    changes = "".join(
        f'<h3>{escape(change.field)}</h3><pre>{"".join(_diff_line(x) for x in change.diff)}</pre>'
        for change in comparison.changes)
    body = (f"<h1>{escape(a)} and {escape(b)}</h1><p class=\"meta\">{escape(parted)}; "
            f"{escape(first)}</p><div class=\"cols\">{columns}</div>"
            f'<section class="diff" id="changes"><h2>what differs</h2>'
            f"{changes or '<p>no content difference</p>'}</section>")
    return document(frame, f"kvtrace ui: {a} and {b}", body)


def _side(run: str, steps: Iterable[Step]) -> str:
    rows = "".join(step_row(run, plain_item(step)) for step in steps)
    rows = rows or "<tr><td>(no more steps)</td></tr>"
    return f'<table class="list"><tbody>{rows}</tbody></table>'


def _diff_line(line: str) -> str:
    css = ("hunk" if line.startswith("@@") else "add" if line.startswith("+")
           else "del" if line.startswith("-") else "")
    return f'<span class="{css}">{escape(line)}</span>'
