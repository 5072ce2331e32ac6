"""A run's section of the page: its totals, then each step as a `<details>` entry.

An entry's summary line has the step's position, kind, one-line summary,
token bars and note count; its body, on click, the full content. A model
call shows the messages that are new since the run's previous model call
(the rest are that call's), its response and tools; a tool call its
arguments, result and error. Token bars, per model call, each as wide as
the prompt: the oracle bound (tokens an exact-prefix cache could reuse,
green, against tokens it must compute) and, where recorded, the provider's
cached tokens (blue) with a mark at the oracle bound's rate.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvtrace.apis.chat import tool_calls_of
from kvtrace.page.contents import PageRun, PageStep, Prompt
from kvtrace.page.graph import kind_class
from kvtrace.page.markup import (
    WHOLE,
    escape,
    parsed_arguments,
    percent,
    pre_block,
    short,
    when,
)
from kvtrace.rendering import content_text
from kvtrace.store.kinds import ModelCall, StepKind, ToolCall, view
from kvtrace.store.present.shown import shown


def run_section(index: int, run: PageRun) -> Iterator[str]:
    model_calls = [s for s in run.steps if s.step.kind == StepKind.MODEL_CALL]
    totals = [f"{len(run.steps)} steps", f"{len(model_calls)} model calls"]
    if run.prompt_tokens:
        totals.append(f"oracle bound: {run.oracle_tokens} of {run.prompt_tokens} prompt tokens "
                      f"reusable ({percent(run.oracle_tokens, run.prompt_tokens)})")
    known = [s for s in model_calls
             if s.provider_cached_tokens is not None and s.provider_prompt_tokens]
    if known:
        cached = sum(s.provider_cached_tokens or 0 for s in known)
        prompt = sum(s.provider_prompt_tokens or 0 for s in known)
        totals.append(f"provider cached {cached} of {prompt} prompt tokens "
                      f"({percent(cached, prompt)}) on the {len(known)} calls reporting it")
    forks = ", ".join(f"<code>{escape(name)}</code> leaves at @{depth}"
                      for name, depth in run.forks)
    problem = (f'<p class="problem">no token bars: {escape(run.token_problem)}</p>'
               if run.token_problem else "")
    largest = max((s.tokens.prompt_tokens for s in run.steps if s.tokens), default=0)
    yield (f'<section class="run" id="run-{index}"><h2>run <code>{escape(run.name)}</code></h2>'
           f'<p class="totals">{escape(" · ".join(totals))}</p>'
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
    shared = (f'<span class="badge">also in {escape(", ".join(item.also_in))}</span>'
              if item.also_in else "")
    notes = (f'<span class="badge">{len(item.notes)} note{"s" if len(item.notes) > 1 else ""}'
             "</span>" if item.notes else "")
    summary = (f'<summary><span class="pos mono">@{step.depth}</span>'
               f'<span class="kind"><i class="dot kind-{kind_class(step.kind)}"></i>'
               f'{escape(step.kind)}</span><span class="sum">{escape(item.summary)}</span>'
               f"{step_bars(item)}{notes}{shared}</summary>")
    classes = "step shared" if item.also_in else "step"
    return (f'<li id="{item.anchor}" class="{classes}" data-step="{escape(step.id)}"><details>'
            f'{summary}<div class="body">{step_body(item, previous)}</div></details></li>')


def step_bars(item: PageStep) -> str:
    rows = []
    tokens = item.tokens
    if tokens is not None and tokens.prompt_tokens:
        reuse = 100 * tokens.oracle_tokens / tokens.prompt_tokens
        label = (f"oracle bound: {tokens.oracle_tokens} of {tokens.prompt_tokens} prompt tokens "
                 f"reusable, {tokens.prompt_tokens - tokens.oracle_tokens} computed")
        rows.append(f'<span class="bar" title="{escape(label)}"><span class="reuse" '
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
        rows.append(f'<span class="bar" title="{escape(label)}"><span class="cached" '
                    f'style="width:{share:.2f}%"></span>{mark}</span>')
    return f'<span class="bars">{"".join(rows)}</span>' if rows else ""


def step_body(item: PageStep, previous: PageStep | None) -> str:
    step = item.step
    facts: list[tuple[str, Any]] = [("id", step.id), ("parent", step.parent_id),
                                    ("recorded", when(step.recorded_at))]
    facts += [(key, value) for key, value in step.meta.items() if key != "extra"]
    tokens = item.tokens
    if tokens is not None:
        facts.append(("oracle bound", f"{tokens.oracle_tokens} of {tokens.prompt_tokens} prompt "
                      f"tokens reusable ({percent(tokens.oracle_tokens, tokens.prompt_tokens)})"))
    if item.provider_cached_tokens is not None:
        facts.append(("provider cached", f"{item.provider_cached_tokens} of "
                      f"{item.provider_prompt_tokens} prompt tokens"))
    rows = "".join(f"<tr><td>{escape(key)}</td><td class=\"mono\">{escape(short(value))}</td></tr>"
                   for key, value in facts)
    parts = [f'<table class="kv">{rows}</table>']
    typed = view(step)
    if isinstance(typed, ModelCall):
        parts.append(_model_call_body(item, previous))
    elif isinstance(typed, ToolCall):
        parts.append(f"<h4>arguments</h4>{pre_block(typed.arguments)}")
        parts.append(f"<h4>result</h4>{pre_block(typed.result)}")
    else:
        for key, value in step.content.items():
            parts.append(f"<h4>{escape(key)}</h4>{pre_block(value)}")
    extra = typed.extra if isinstance(typed, (ModelCall, ToolCall)) else None
    if extra:
        parts.append(f"<details><summary>extra</summary>{pre_block(extra)}</details>")
    if item.notes:
        notes = "".join(f"<li><b>{escape(n.author or 'anonymous')}</b> "
                        f"{escape(when(n.created_at))}: {escape(n.text)}</li>"
                        for n in item.notes)
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
    shown = "".join(message_html(m) for m in prompt.new) or "<p>(none)</p>"
    parts = [head, shown, "<h4>response</h4>", message_html(call.response)]
    tools = call.tools
    if tools:
        parts.append(f"<details><summary>tools ({len(tools)})</summary>{pre_block(tools)}"
                     "</details>")
    return "".join(parts)


def message_html(message: Any) -> str:
    if not isinstance(message, dict):
        return pre_block(message)
    role = str(message.get("role", "?"))
    facts = [f"answers {message['tool_call_id']}" if message.get("tool_call_id") else "",
             f"name {message['name']}" if message.get("name") else ""]
    label = " · ".join(f for f in facts if f)
    parts = [f'<div class="msg role-{escape(role)}"><span class="role">{escape(role)}</span>'
             + (f" <span class=\"mono\">{escape(label)}</span>" if label else "")]
    if message.get("reasoning_content"):
        reasoning = shown(message["reasoning_content"], whole=WHOLE)
        parts.append(f"<pre>[reasoning] {escape(reasoning)}</pre>")
    content = message.get("content")
    if content is not None:
        text = content_text(content) if isinstance(content, (str, list)) else content
        parts.append(pre_block(text))
    for call in tool_calls_of(message):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            ident = f" ({call['id']})" if call.get("id") else ""
            parts.append(f"<div class=\"mono\">→ {escape(function.get('name'))}"
                         f"{escape(ident)}</div>"
                         f"{pre_block(parsed_arguments(function.get('arguments')))}")
    parts.append("</div>")
    return "".join(parts)
