"""The report's inline CSS and script, and the policy that lets the page load nothing else.

Shared by the static report (render.py) and the live UI (kvtrace/ui), so
that both draw the same records the same way. `CSP` forbids every source
but the page's own inline style and script: a recorded `<script>` is text
on the page, never code.
"""

from __future__ import annotations

CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
       "img-src data:; base-uri 'none'; form-action 'none'")

STYLE = """
:root { --reuse: #2e9d5b; --compute: #e08a2c; --cached: #3b6fd4; --rest: #c9ced6;
        --model: #17a2b8; --tool: #8c564b; --note: #c98a00; --other: #7a7f87; }
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
