"""The report as one self-contained HTML page (no network: inline CSS and script only).

Layout: a header (runs, store, tokenizer), the branch graph as inline SVG
(one lane per run, each step once, a node links to the step's entry), then
one section per run listing every step as a `<details>` element: its
position, kind, one-line summary, token bars and note count in the
summary line, its full content on click. A model call shows the messages
that are new since the run's previous model call (the rest are that
call's), its response and tools; a tool call its arguments, result and
error. Token bars, per model call, each as wide as the prompt: the oracle
bound (tokens an exact-prefix cache could reuse, green, against tokens it
must compute) and, where recorded, the provider's cached tokens (blue) with
a mark at the oracle bound's rate.

Every recorded value (content, names, notes) goes through `html.escape`, after
`kvtrace.inert` shows its control, format and bidi characters as escapes,
and a Content-Security-Policy meta tag forbids loading anything: a recorded
`<script>` is text on the page, never code.
"""

from __future__ import annotations

import datetime
import html
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtrace.inert import inert
from kvtrace.page.contents import GraphNode, Page, PageRun, PageStep, Prompt, gather
from kvtrace.rendering import content_text
from kvtrace.replay.backend import Tokenizer
from kvtrace.store import OnStep, Store
from kvtrace.store.kinds import ModelCall, StepKind, ToolCall, view
from kvtrace.store.messages import tool_calls_of

MAX_TEXT = 200_000  # characters of one value shown; `kvtrace show` has the rest
LANE, ROW, MARGIN = 22, 22, 14  # graph geometry in pixels

CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
       "img-src data:; base-uri 'none'; form-action 'none'")

STYLE = """
:root { --reuse: #2e9d5b; --compute: #e08a2c; --cached: #3b6fd4; --rest: #c9ced6;
        --model: #3b6fd4; --tool: #2e9d5b; --note: #c98a00; --other: #7a7f87; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto;
       max-width: 1200px; padding: 16px 24px 48px; color: #1d2024; background: #fbfbfc; }
h1 { font-size: 22px; margin: 4px 0; } h2 { font-size: 18px; margin: 28px 0 8px; }
code, pre, .mono { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px; }
pre { white-space: pre-wrap; word-break: break-word; background: #f1f3f5; padding: 6px 8px;
      border-radius: 4px; margin: 4px 0; max-height: 480px; overflow: auto; }
.meta, .totals, .forks { color: #50565e; margin: 4px 0; }
button { font: inherit; padding: 2px 10px; margin-right: 6px; cursor: pointer; }
#graph .scroll { overflow-x: auto; }
#graph svg { background: #fff; border: 1px solid #e1e4e8; border-radius: 6px; }
#graph svg a { cursor: pointer; }
#graph text { font: 12px ui-monospace, "DejaVu Sans Mono", monospace; fill: #1d2024; }
#graph text.head { font-weight: bold; fill: #8a2be2; }
.node { stroke: #fff; stroke-width: 1.5; } .edge { fill: none; stroke: #9aa1aa; stroke-width: 2; }
.node.kind-model_call, .dot.kind-model_call { fill: var(--model); background: var(--model); }
.node.kind-tool_call, .dot.kind-tool_call { fill: var(--tool); background: var(--tool); }
.node.kind-note, .dot.kind-note { fill: var(--note); background: var(--note); }
.node.kind-other, .dot.kind-other { fill: var(--other); background: var(--other); }
.legend span { margin-right: 14px; color: #50565e; }
.dot { display: inline-block; width: 10px; height: 10px; border-radius: 50%;
       margin-right: 4px; vertical-align: middle; }
ol.steps { list-style: none; padding: 0; margin: 0; }
li.step { border: 1px solid #e1e4e8; border-radius: 6px; margin: 4px 0; background: #fff; }
li.step.target { outline: 2px solid #8a2be2; }
li.step.shared { background: #f7f8fa; }
summary { cursor: pointer; padding: 5px 8px; display: flex; gap: 10px; align-items: center; }
summary .pos { color: #50565e; min-width: 38px; }
summary .kind { min-width: 84px; }
summary .sum { flex: 1; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.badge { background: #fff3cd; border: 1px solid #e0c46c; border-radius: 10px; padding: 0 7px;
         font-size: 12px; }
.bars { display: flex; flex-direction: column; gap: 2px; min-width: 180px; }
.bar { display: flex; width: 180px; height: 7px; border-radius: 3px; overflow: hidden;
       background: var(--rest); }
.bar .reuse { background: var(--reuse); } .bar .compute { background: var(--compute); }
.bar .cached { background: var(--cached); }
.bar { position: relative; }
.bar .mark { position: absolute; top: 0; bottom: 0; width: 2px; margin-left: -1px;
             background: #1d2024; }
.barlabel { font-size: 11px; color: #50565e; }
.body { padding: 4px 12px 10px; border-top: 1px solid #eef0f2; }
.body h4 { margin: 10px 0 2px; font-size: 13px; }
table.kv td { vertical-align: top; padding: 1px 10px 1px 0; }
table.kv td:first-child { color: #50565e; white-space: nowrap; }
.msg { border-left: 3px solid #c9ced6; padding-left: 8px; margin: 6px 0; }
.msg .role { font-weight: 600; }
.msg.role-user { border-color: #3b6fd4; } .msg.role-assistant { border-color: #2e9d5b; }
.msg.role-tool { border-color: #e08a2c; } .msg.role-system { border-color: #7a7f87; }
ul.notes { margin: 4px 0; padding-left: 18px; } ul.notes li { margin: 2px 0; }
.problem { color: #a1260d; }
"""

SCRIPT = """
(function () {
  function setAll(open) {
    document.querySelectorAll("li.step > details").forEach(function (d) { d.open = open; });
  }
  document.getElementById("expand-all").addEventListener("click", function () { setAll(true); });
  document.getElementById("collapse-all").addEventListener("click", function () { setAll(false); });
  function reveal() {
    document.querySelectorAll("li.step.target").forEach(function (li) {
      li.classList.remove("target");
    });
    var id = decodeURIComponent(window.location.hash.slice(1));
    var entry = id ? document.getElementById(id) : null;
    if (!entry) { return; }
    var details = entry.querySelector("details");
    if (details) { details.open = true; }
    entry.classList.add("target");
  }
  window.addEventListener("hashchange", reveal);
  reveal();
})();
"""


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
    tokens = (f"tokens counted with the tokenizer of {_e(page.tokenizer)}" if page.tokenizer
              else "no token counts of kvtrace's own (no tokenizer)")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>kvtrace report: {_e(names)}</title>",
        f"<style>{STYLE}</style></head><body>",
        "<header><h1>kvtrace report</h1>",
        f'<p class="meta">runs: {_e(names)} · store: <code>{_e(page.store_url)}</code> · '
        f"{tokens} · written {_e(_when(datetime.datetime.now(datetime.UTC).timestamp()))}</p>",
        '<p class="legend"><span><i class="dot" style="background:var(--reuse)"></i>reusable '
        '(oracle bound)</span><span><i class="dot" style="background:var(--compute)"></i>'
        'computed</span><span><i class="dot" style="background:var(--cached)"></i>provider '
        "cached (the black mark: the oracle bound's rate)</span></p>",
        '<p><button id="expand-all" type="button">expand all</button>'
        '<button id="collapse-all" type="button">collapse all</button></p></header>',
        _graph(page),
    ]
    for part in parts:
        yield part + "\n"
    for index, run in enumerate(page.runs):
        yield from _run_section(index, run)
        yield "\n"
    yield f"<script>{SCRIPT}</script>\n</body></html>\n"


# -- the branch graph -----------------------------------------------------------


def _graph(page: Page) -> str:
    nodes = page.nodes
    if not nodes:
        return '<section id="graph"><h2>Branch graph</h2><p>no steps yet</p></section>'
    where = {node.step_id: node for node in nodes}
    max_depth = max(node.depth for node in nodes)
    text_x = MARGIN * 2 + LANE * len(page.lanes)
    width = text_x + 760
    height = MARGIN * 2 + ROW * (max_depth - 1) + 8
    rows: dict[int, list[GraphNode]] = {}
    for node in nodes:
        rows.setdefault(node.depth, []).append(node)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="branch graph">']
    for node in nodes:
        parent = where.get(node.parent_id) if node.parent_id else None
        if parent is None:
            continue
        (x1, y1), (x2, y2) = _xy(parent), _xy(node)
        middle = (y1 + y2) / 2
        out.append(f'<path class="edge" d="M{x1} {y1} C{x1} {middle} {x2} {middle} {x2} {y2}"/>')
    for node in nodes:
        x, y = _xy(node)
        circle = (f'<circle class="node kind-{_kind_class(node.kind)}" cx="{x}" cy="{y}" r="6">'
                  f"<title>@{node.depth} {_e(node.kind)} {_e(node.summary)}</title></circle>")
        out.append(f'<a href="#{node.anchor}">{circle}</a>' if node.anchor else circle)
    for depth, row in sorted(rows.items()):
        y = MARGIN + ROW * (depth - 1) + 4
        labels = []
        width = max(16, 90 // len(row))  # several steps at one depth share the line
        for node in row:
            heads = "".join(f'<tspan class="head">({_e(h)}) </tspan>' for h in node.heads)
            label = f"{heads}@{depth} {_e(node.kind)} {_e(_cut(node.summary, width))}"
            labels.append(f'<a href="#{node.anchor}">{label}</a>' if node.anchor else label)
        out.append(f'<text x="{text_x}" y="{y}">{" | ".join(labels)}</text>')
    out.append("</svg>")
    lanes = " ".join(f"<span>lane {i + 1}: <code>{_e(name)}</code></span>"
                     for i, name in enumerate(page.lanes))
    kinds = " ".join(f'<span><i class="dot kind-{k}"></i>{k}</span>'
                     for k in (*_DRAWN_KINDS, "other"))
    more = (f"<p class=\"meta\">{page.num_forks_left_out} more forks not drawn</p>"
            if page.num_forks_left_out else "")
    return (f'<section id="graph"><h2>Branch graph</h2><div class="scroll">{"".join(out)}</div>'
            f'<p class="legend">{kinds}</p><p class="legend">{lanes}</p>{more}</section>')


def _xy(node: GraphNode) -> tuple[int, int]:
    return MARGIN + LANE * node.lane, MARGIN + ROW * (node.depth - 1)


_DRAWN_KINDS = (StepKind.MODEL_CALL, StepKind.TOOL_CALL, StepKind.NOTE)


def _kind_class(kind: str) -> str:
    return kind if kind in _DRAWN_KINDS else "other"


# -- runs and steps ---------------------------------------------------------------


def _run_section(index: int, run: PageRun) -> Iterator[str]:
    model_calls = [s for s in run.steps if s.step.kind == StepKind.MODEL_CALL]
    totals = [f"{len(run.steps)} steps", f"{len(model_calls)} model calls"]
    if run.prompt_tokens:
        totals.append(f"oracle bound: {run.oracle_tokens} of {run.prompt_tokens} prompt tokens "
                      f"reusable ({_percent(run.oracle_tokens, run.prompt_tokens)})")
    known = [s for s in model_calls
             if s.provider_cached_tokens is not None and s.provider_prompt_tokens]
    if known:
        cached = sum(s.provider_cached_tokens or 0 for s in known)
        prompt = sum(s.provider_prompt_tokens or 0 for s in known)
        totals.append(f"provider cached {cached} of {prompt} prompt tokens "
                      f"({_percent(cached, prompt)}) on the {len(known)} calls reporting it")
    forks = ", ".join(f"<code>{_e(name)}</code> leaves at @{depth}" for name, depth in run.forks)
    problem = (f'<p class="problem">no token bars: {_e(run.token_problem)}</p>'
               if run.token_problem else "")
    largest = max((s.tokens.prompt_tokens for s in run.steps if s.tokens), default=0)
    yield (f'<section class="run" id="run-{index}"><h2>run <code>{_e(run.name)}</code></h2>'
           f'<p class="totals">{_e(" · ".join(totals))}</p>'
           + (f'<p class="forks">forks: {forks}</p>' if forks else "")
           + f'{problem}<ol class="steps">')
    previous: PageStep | None = None
    for step in run.steps:
        yield _step_item(step, previous, largest)
        if step.step.kind == StepKind.MODEL_CALL:
            previous = step
    if not run.steps:
        yield "<li>no steps yet</li>"
    yield "</ol></section>"


def _step_item(item: PageStep, previous: PageStep | None, largest: int) -> str:
    step = item.step
    shared = (f'<span class="badge">also in {_e(", ".join(item.also_in))}</span>'
              if item.also_in else "")
    notes = (f'<span class="badge">{len(item.notes)} note{"s" if len(item.notes) > 1 else ""}'
             "</span>" if item.notes else "")
    summary = (f'<summary><span class="pos mono">@{step.depth}</span>'
               f'<span class="kind"><i class="dot kind-{_kind_class(step.kind)}"></i>'
               f'{_e(step.kind)}</span><span class="sum">{_e(item.summary)}</span>'
               f"{_bars(item)}{notes}{shared}</summary>")
    classes = "step shared" if item.also_in else "step"
    return (f'<li id="{item.anchor}" class="{classes}" data-step="{_e(step.id)}"><details>'
            f'{summary}<div class="body">{_step_body(item, previous)}</div></details></li>')


def _bars(item: PageStep) -> str:
    rows = []
    tokens = item.tokens
    if tokens is not None and tokens.prompt_tokens:
        reuse = 100 * tokens.oracle_tokens / tokens.prompt_tokens
        label = (f"oracle bound: {tokens.oracle_tokens} of {tokens.prompt_tokens} prompt tokens "
                 f"reusable, {tokens.prompt_tokens - tokens.oracle_tokens} computed")
        rows.append(f'<span class="bar" title="{_e(label)}"><span class="reuse" '
                    f'style="width:{reuse:.2f}%"></span><span class="compute" '
                    f'style="width:{100 - reuse:.2f}%"></span></span>')
    cached, prompt = item.provider_cached_tokens, item.provider_prompt_tokens
    if cached is not None and prompt:
        share = min(100.0, 100 * cached / prompt)
        label = f"provider cached {cached} of {prompt} prompt tokens (its own tokenizer)"
        mark = ""
        if tokens is not None and tokens.prompt_tokens:  # the bound, as a rate, for comparison
            bound = 100 * tokens.oracle_tokens / tokens.prompt_tokens
            label += f"; the mark is the oracle bound ({bound:.1f}%)"
            mark = f'<span class="mark" style="left:{bound:.2f}%"></span>'
        rows.append(f'<span class="bar" title="{_e(label)}"><span class="cached" '
                    f'style="width:{share:.2f}%"></span>{mark}</span>')
    return f'<span class="bars">{"".join(rows)}</span>' if rows else ""


def _step_body(item: PageStep, previous: PageStep | None) -> str:
    step = item.step
    facts: list[tuple[str, Any]] = [("id", step.id), ("parent", step.parent_id),
                                    ("recorded", _when(step.recorded_at))]
    facts += [(key, value) for key, value in step.meta.items() if key != "extra"]
    tokens = item.tokens
    if tokens is not None:
        facts.append(("oracle bound", f"{tokens.oracle_tokens} of {tokens.prompt_tokens} prompt "
                      f"tokens reusable ({_percent(tokens.oracle_tokens, tokens.prompt_tokens)})"))
    if item.provider_cached_tokens is not None:
        facts.append(("provider cached", f"{item.provider_cached_tokens} of "
                      f"{item.provider_prompt_tokens} prompt tokens"))
    rows = "".join(f"<tr><td>{_e(key)}</td><td class=\"mono\">{_e(_short(value))}</td></tr>"
                   for key, value in facts)
    parts = [f'<table class="kv">{rows}</table>']
    typed = view(step)
    if isinstance(typed, ModelCall):
        parts.append(_model_call_body(item, previous))
    elif isinstance(typed, ToolCall):
        parts.append(f"<h4>arguments</h4>{_pre(typed.arguments)}")
        parts.append(f"<h4>result</h4>{_pre(typed.result)}")
    else:
        for key, value in step.content.items():
            parts.append(f"<h4>{_e(key)}</h4>{_pre(value)}")
    extra = typed.extra if isinstance(typed, (ModelCall, ToolCall)) else None
    if extra:
        parts.append(f"<details><summary>extra</summary>{_pre(extra)}</details>")
    if item.notes:
        notes = "".join(f"<li><b>{_e(n.author or 'anonymous')}</b> {_e(_when(n.created_at))}: "
                        f"{_e(n.text)}</li>" for n in item.notes)
        parts.append(f'<h4>notes</h4><ul class="notes">{notes}</ul>')
    return "".join(parts)


def _model_call_body(item: PageStep, previous: PageStep | None) -> str:
    call = ModelCall(item.step)
    prompt = item.prompt or Prompt.of(call, ModelCall(previous.step) if previous else None)
    known = prompt.num_known
    head = (f"<h4>prompt: {prompt.num_messages} messages, the first {known} as sent to or "
            f"answered by @{previous.step.depth}; new ones:</h4>"
            if known and previous is not None
            else f"<h4>prompt: {prompt.num_messages} messages</h4>")
    shown = "".join(_message(m) for m in prompt.new) or "<p>(none)</p>"
    parts = [head, shown, "<h4>response</h4>", _message(call.response)]
    tools = call.tools
    if tools:
        parts.append(f"<details><summary>tools ({len(tools)})</summary>{_pre(tools)}</details>")
    return "".join(parts)


def _message(message: Any) -> str:
    if not isinstance(message, dict):
        return _pre(message)
    role = str(message.get("role", "?"))
    facts = [f"answers {message['tool_call_id']}" if message.get("tool_call_id") else "",
             f"name {message['name']}" if message.get("name") else ""]
    label = " · ".join(f for f in facts if f)
    parts = [f'<div class="msg role-{_e(role)}"><span class="role">{_e(role)}</span>'
             + (f" <span class=\"mono\">{_e(label)}</span>" if label else "")]
    if message.get("reasoning_content"):
        parts.append(f"<pre>[reasoning] {_e(_cut(message['reasoning_content'], MAX_TEXT))}</pre>")
    content = message.get("content")
    if content is not None:
        text = content_text(content) if isinstance(content, (str, list)) else content
        parts.append(_pre(text))
    for call in tool_calls_of(message):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            ident = f" ({call['id']})" if call.get("id") else ""
            parts.append(f"<div class=\"mono\">→ {_e(function.get('name'))}{_e(ident)}</div>"
                         f"{_pre(_arguments(function.get('arguments')))}")
    parts.append("</div>")
    return "".join(parts)


# -- helpers ----------------------------------------------------------------------


def _e(value: Any) -> str:
    """Escaped for HTML text and attribute values, with controls and bidi characters visible."""
    return html.escape(inert(str(value)), quote=True)


def _pre(value: Any) -> str:
    if isinstance(value, bytes):
        text = value.decode("utf-8", errors="replace")
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    return f"<pre>{_e(_cut(text, MAX_TEXT))}</pre>"


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return _cut(text, 2_000)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)" if limit > 200 else (
        text[: limit - 1] + "…")


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0%"


def _when(timestamp: float) -> str:
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


# -- what the live UI (kvtrace/ui) reuses: one way to escape and draw the same records -------

escape = _e  # recorded text -> inert, escaped HTML text or attribute value
pre_block = _pre  # a value as an escaped <pre> (JSON pretty-printed, long text cut)
message_html = _message  # one chat message: role, content, tool calls
graph_section = _graph  # the branch graph of a Page, as inline SVG
step_bars = _bars  # the oracle-bound and provider-cached bars of a PageStep
step_body = _step_body  # a step's facts, content, extra and notes
when = _when  # a timestamp as ISO 8601 UTC
