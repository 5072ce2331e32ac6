"""The pages that change as one looks, and the server-sent events they follow.

The live tail appends the rows the server draws for new steps (`views.step_row`,
escaped there); a replay's page builds its hit bars from numbers, setting
text only; the runs page (views.py) updates its heads from `heads_event`.
An event's data is one line of ASCII JSON.
"""

from __future__ import annotations

import json
from typing import Any

from kvtrace.page.render import escape
from kvtrace.store import RunInfo, Step
from kvtrace.ui.views import Frame, document, link, plain_item, step_row


def heads_event(runs: list[RunInfo], paused: set[str]) -> dict[str, Any]:
    """What the runs page's live stream sends: each run's depth, head and state."""
    return {"runs": [{"name": r.name, "depth": r.depth,
                      "head": r.head_id[:12] if r.head_id else "(empty)",
                      "paused": r.name in paused} for r in runs]}


# -- the live tail -------------------------------------------------------------------------


def tail_page(frame: Frame, name: str, steps: list[Step], cursor: int) -> str:
    rows = "".join(step_row(name, plain_item(step)) for step in steps)
    body = (f'<h1>live tail of <a href="{escape(link("/run", name=name))}"><code>'
            f"{escape(name)}</code></a></h1>"
            f'<p class="meta" id="tail-state">showing the last {len(steps)} steps; new ones '
            "appear as they are recorded</p>"
            f'<table class="list" id="tail" data-events="'
            f'{escape(link("/events/tail", name=name, since=str(cursor)))}"><tbody>{rows}'
            '</tbody></table><ul id="moves" class="notes"></ul>')
    return document(frame, f"kvtrace ui: tail {name}", body, _TAIL_SCRIPT)


_TAIL_SCRIPT = """
(function () {
  var table = document.getElementById("tail");
  var source = new EventSource(table.dataset.events);
  source.addEventListener("step", function (event) {
    var data = JSON.parse(event.data);
    var body = table.querySelector("tbody");
    if (body.querySelector('tr[data-step="' + data.id + '"]')) { return; }  /* shown already */
    body.insertAdjacentHTML("beforeend", data.row);  /* escaped by the server */
    body.lastElementChild.classList.add("fresh");
  });
  source.addEventListener("move", function (event) {
    var data = JSON.parse(event.data);
    var item = document.createElement("li");
    item.textContent = data.kind + ": " + data.message;
    document.getElementById("moves").appendChild(item);
  });
})();
"""


# -- a replay ------------------------------------------------------------------------------


def replay_page(frame: Frame, snapshot: dict[str, Any]) -> str:
    page = escape(link("/run", name=snapshot["run"]))
    body = (f'<h1>{escape(snapshot["mode"])} of <a href="{page}">'
            f'<code>{escape(snapshot["run"])}</code></a></h1>'
            f'<p class="meta" id="replay-state">{escape(snapshot["state"])}: 0 of '
            f'{snapshot["total"]} model calls</p>'
            '<div class="progress"><span id="progress" style="width:0%"></span></div>'
            '<p class="error" id="replay-error" hidden></p>'
            '<h2>hit per model call</h2><p class="legend"><span><i class="dot" '
            'style="background:var(--reuse)"></i>reused</span><span><i class="dot" '
            'style="background:var(--compute)"></i>computed</span><span>the black mark: the '
            'oracle bound</span></p>'
            f'<table class="list" id="hits" data-events="/events/replay/{snapshot["id"]}">'
            "<tbody></tbody></table>")
    return document(frame, f"kvtrace ui: replay {snapshot['run']}", body, _REPLAY_SCRIPT)


_REPLAY_SCRIPT = """
(function () {
  var table = document.getElementById("hits");
  var source = new EventSource(table.dataset.events);
  function cell(text) { var td = document.createElement("td"); td.textContent = text; return td; }
  source.addEventListener("progress", function (event) {
    var data = JSON.parse(event.data);
    var share = data.total ? 100 * data.done / data.total : 100;
    document.getElementById("progress").style.width = share + "%";
    document.getElementById("replay-state").textContent =
      data.state + ": " + data.done + " of " + data.total + " model calls" +
      (data.hit_rate === null ? "" : ", hit rate " + (100 * data.hit_rate).toFixed(1) + "%");
    var body = table.querySelector("tbody");
    for (var i = body.children.length; i < data.steps.length; i++) {
      var step = data.steps[i], row = document.createElement("tr");
      row.className = "hit";
      row.appendChild(cell("@" + step.depth));
      var bar = document.createElement("span"), reused = document.createElement("span"),
          computed = document.createElement("span");
      bar.className = "bar"; reused.className = "reuse"; computed.className = "computed";
      var known = step.reused_tokens !== null && step.prompt_tokens > 0;
      var r = known ? 100 * step.reused_tokens / step.prompt_tokens : 0;
      reused.style.width = r + "%"; computed.style.width = (known ? 100 - r : 0) + "%";
      bar.appendChild(reused); bar.appendChild(computed);
      if (step.oracle_tokens !== null && step.prompt_tokens > 0) {
        var mark = document.createElement("span");
        mark.className = "mark";
        mark.style.left = (100 * step.oracle_tokens / step.prompt_tokens) + "%";
        bar.appendChild(mark);
      }
      var td = document.createElement("td"); td.appendChild(bar); row.appendChild(td);
      row.appendChild(cell((known ? step.reused_tokens : "?") + " of " + step.prompt_tokens +
                           " reused" + (step.is_match === false ? " · differs" : "")));
      body.appendChild(row);
    }
    if (data.error) {
      var error = document.getElementById("replay-error");
      error.textContent = data.error; error.hidden = false;
    }
    if (data.state === "done" || data.state === "failed") { source.close(); }
  });
})();
"""


def sse(event: str, data: dict[str, Any], *, ident: int | None = None) -> str:
    """One server-sent event: its data one line of ASCII JSON (newlines, controls escaped).

    `ident` becomes the event's id, which a reconnecting EventSource sends back
    (Last-Event-ID) so that the stream resumes after it.
    """
    head = f"id: {ident}\n" if ident is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n"

