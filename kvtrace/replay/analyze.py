"""Why prompts miss the cache, found with the tokenizer alone (no forward pass).

For every model call on the path to a step: the oracle bound (see oracle.py)
and whether the prompt extends the previous call's context (its prompt and
output). A call that does not is a **prefix breaker**: every token of the
previous context after the break point must be computed again. For each
breaker, analyze gives the token and character position, a snippet of both
sides, and names the likely cause by comparing the two calls' messages:

- ``timestamp``: a date or time changed inside a message (typically the
  system prompt), so everything after it misses;
- ``changing_number``: some other number changed (a counter, an id);
- ``reordered_list``: the same lines or items in another order (a tool list
  built from an unordered set, say);
- ``inserted_in_front``: new text or messages put before earlier context (a
  retrieved document inserted ahead of the conversation);
- ``messages_removed``: earlier messages dropped (context trimming);
- ``edited_output``: the agent sent back a different text than the model produced;
- ``retokenized_output``: same text, but the model's generated tokens
  re-tokenise differently in the next prompt (BPE is not unique);
- ``template``: same messages, yet the chat template renders earlier turns
  differently once more turns follow;
- ``changed_message``: anything else; the message index and role say where.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtrace.errors import ReplayError
from kvtrace.replay.backend import Message, Tokenizer
from kvtrace.replay.oracle import PrefixOracle, common_prefix_length
from kvtrace.replay.recording import (
    assistant_message,
    expected_output_ids,
    response_text,
    step_messages,
    templated_output_ids,
)
from kvtrace.store import Step, Store

_SNIPPET = 12  # tokens each side of a break
_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}([ T]\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?)?|\d{1,2}:\d{2}(:\d{2})?"
    r"|\b\d{1,2}/\d{1,2}/\d{2,4}\b|\b1\d{9}(\.\d+)?\b"
    r"|\b(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day\b"
    r"|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? \d{1,2}\b"
)


@dataclass(frozen=True, slots=True)
class PrefixBreaker:
    """A model call whose prompt stops sharing the previous call's context early."""

    index: int
    step_id: str
    token_position: int  # first token of the prompt that differs from the previous context
    char_position: int  # the same place in the rendered prompt text
    lost_tokens: int  # tokens of the previous context that cannot be reused
    cause: str
    explanation: str
    message_index: int | None
    before: str  # text both share, just before the break
    previous: str  # what the previous context continued with
    current: str  # what this prompt continues with

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "step_id": self.step_id,
            "token_position": self.token_position,
            "char_position": self.char_position,
            "lost_tokens": self.lost_tokens,
            "cause": self.cause,
            "explanation": self.explanation,
            "message_index": self.message_index,
            "before": self.before,
            "previous": self.previous,
            "current": self.current,
        }


@dataclass(frozen=True, slots=True)
class StepAnalysis:
    """The oracle bound of one model call."""

    index: int
    step_id: str
    depth: int
    prompt_tokens: int
    oracle_tokens: int
    shared_with_previous: int | None  # tokens shared with the previous call's context

    @property
    def oracle_hit_rate(self) -> float:
        return self.oracle_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "step_id": self.step_id,
            "depth": self.depth,
            "prompt_tokens": self.prompt_tokens,
            "oracle_tokens": self.oracle_tokens,
            "oracle_hit_rate": round(self.oracle_hit_rate, 6),
            "shared_with_previous": self.shared_with_previous,
        }


@dataclass(frozen=True, slots=True)
class Analysis:
    """Oracle bound per model call and the prefix breakers of a run."""

    spec: str
    target_id: str
    steps: list[StepAnalysis]
    breakers: list[PrefixBreaker]

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.steps)

    @property
    def oracle_tokens(self) -> int:
        return sum(s.oracle_tokens for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        total = self.prompt_tokens
        return {
            "run": self.spec,
            "target": self.target_id,
            "steps": [s.to_dict() for s in self.steps],
            "breakers": [b.to_dict() for b in self.breakers],
            "total": {
                "steps": len(self.steps),
                "prompt_tokens": total,
                "oracle_tokens": self.oracle_tokens,
                "oracle_hit_rate": round(self.oracle_tokens / total, 6) if total else 0.0,
                "breakers": len(self.breakers),
                "lost_tokens": sum(b.lost_tokens for b in self.breakers),
            },
        }


def analyze(store: Store, spec: str, tokenizer: Tokenizer) -> Analysis:
    """The oracle bound and the prefix breakers of the run (or step) `spec`."""
    path = store.path(spec)
    if not path:
        raise ReplayError(f"{spec!r} has no steps to analyze: record a model call on it first")
    model_steps = [s for s in path if s.kind == "model_call"]
    oracle = PrefixOracle()
    steps: list[StepAnalysis] = []
    breakers: list[PrefixBreaker] = []
    previous: tuple[Step, list[int], list[int]] | None = None  # step, prompt ids, output ids
    for index, step in enumerate(model_steps, start=1):
        prompt = tokenizer.chat_tokens(step_messages(step))
        output = expected_output_ids(step, tokenizer, prompt)
        shared: int | None = None
        if previous is not None:
            context = previous[1] + previous[2]
            shared = common_prefix_length(prompt, context)
            if shared < len(context):
                breakers.append(_breaker(index, step, prompt, previous, shared, tokenizer))
        steps.append(StepAnalysis(index, step.id, step.depth, len(prompt), oracle.bound(prompt),
                                  shared))
        oracle.add(prompt + output, label=step.id)
        previous = (step, prompt, output)
    return Analysis(spec, path[-1].id, steps, breakers)


def _breaker(
    index: int,
    step: Step,
    prompt: list[int],
    previous: tuple[Step, list[int], list[int]],
    at: int,
    tokenizer: Tokenizer,
) -> PrefixBreaker:
    prev_step, prev_prompt, prev_output = previous
    context = prev_prompt + prev_output
    cause, explanation, message_index = _cause(
        step, prev_step, prev_prompt, prev_output, at, tokenizer
    )
    return PrefixBreaker(
        index=index,
        step_id=step.id,
        token_position=at,
        char_position=len(_text_of(tokenizer, prompt[:at])),
        lost_tokens=len(context) - at,
        cause=cause,
        explanation=explanation,
        message_index=message_index,
        before=_text_of(tokenizer, prompt[max(0, at - _SNIPPET) : at]),
        previous=_text_of(tokenizer, context[at : at + _SNIPPET]),
        current=_text_of(tokenizer, prompt[at : at + _SNIPPET]),
    )


def _cause(
    step: Step,
    prev_step: Step,
    prev_prompt: list[int],
    prev_output: list[int],
    at: int,
    tokenizer: Tokenizer,
) -> tuple[str, str, int | None]:
    """Name why the prompt parts from the previous context (see the module docstring)."""
    now = step_messages(step)
    prev_text = response_text(prev_step)
    before = [*step_messages(prev_step), assistant_message(prev_text)]
    k = next((i for i, (a, b) in enumerate(zip(before, now, strict=False)) if a != b), None)
    if k is None:
        if len(now) < len(before):
            return ("messages_removed", "the prompt leaves out the previous response", None)
        if at >= len(prev_prompt):
            templated = templated_output_ids(tokenizer, step_messages(prev_step), prev_text,
                                             prev_prompt)
            if templated != prev_output:
                return ("retokenized_output",
                        "the previous response's text is unchanged but its generated tokens "
                        "re-tokenise differently in this prompt; feed back the generated "
                        "token ids, or accept a miss from here", len(before) - 1)
        return ("template", "the messages extend the previous ones, but the chat template "
                "renders the earlier turns differently once more turns follow", None)
    old, new = before[k], now[k]
    role = str(new.get("role", "?"))
    where = f"message {k} ({role})"
    if k == len(before) - 1 and new.get("role") == "assistant":
        return ("edited_output", f"the agent sent back the model's response ({where}) "
                "changed; send it back verbatim to keep the cache", k)
    if any(now[k + j : k + j + 1] == [old] for j in (1, 2, 3)):
        return ("inserted_in_front", f"new message(s) inserted before {where}, ahead of "
                "earlier context; put new content after the stable prefix", k)
    if any(before[k + j : k + j + 1] == [new] for j in (1, 2, 3)):
        return ("messages_removed", f"earlier messages dropped at {where} (context trimming)", k)
    old_text, new_text = _text(old), _text(new)
    if old.get("role") != new.get("role"):
        return ("changed_message", f"{where} has another role than before", k)
    if old_text and new_text.endswith(old_text) and len(new_text) > len(old_text):
        return ("inserted_in_front", f"text inserted at the start of {where}, ahead of "
                "earlier context (a retrieved document?); append it instead", k)
    if _is_reordered(old_text, new_text):
        what = "tool list" if "tool" in (old_text + new_text).lower() else "list"
        return ("reordered_list", f"the same {what} in another order in {where}; "
                "sort it so that it renders identically every call", k)
    kind = _changing_span(old_text, new_text)
    if kind == "timestamp":
        place = "the system prompt" if role == "system" else where
        return ("timestamp", f"a date or time in {place} changes between calls; "
                "drop it or move it to the end of the prompt", k)
    if kind == "number":
        return ("changing_number", f"a number in {where} changes between calls "
                "(a counter or id?); keep the prefix stable", k)
    return ("changed_message", f"{where} differs from the previous call's", k)


def _text_of(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Decoded with special tokens kept: positions then count the rendered prompt."""
    return tokenizer.decode(ids, skip_special_tokens=False)


def _text(message: Message) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else str(content)


def _is_reordered(old: str, new: str) -> bool:
    """The same lines (or comma-separated items) in a different order."""
    for separator in ("\n", ","):
        a, b = old.split(separator), new.split(separator)
        if len(a) > 1 and a != b and sorted(s.strip() for s in a) == sorted(s.strip() for s in b):
            return True
    return False


def _changing_span(old: str, new: str) -> str | None:
    """"timestamp" or "number" when the texts differ only inside such a span, else None."""
    start = common_prefix_length(old, new)
    tail = common_prefix_length(old[start:][::-1], new[start:][::-1])
    old_stop, new_stop = len(old) - tail, len(new) - tail
    if _overlaps_time(old, start, old_stop) and _overlaps_time(new, start, new_stop):
        return "timestamp"
    while start > 0 and old[start - 1].isdigit():
        start -= 1
    old_mid, new_mid = old[start:old_stop].strip(), new[start:new_stop].strip()
    if re.fullmatch(r"[\d.,]+", old_mid) and re.fullmatch(r"[\d.,]+", new_mid):
        return "number"
    return None


def _overlaps_time(text: str, start: int, stop: int) -> bool:
    """Whether a date or time in `text` covers part of the changed span [start, stop)."""
    low = max(0, start - 30)
    for match in _TIME.finditer(text, low, min(len(text), stop + 30)):
        if match.start() <= max(start, stop - 1) and match.end() > start:
            return True
    return False


def render_analysis(analysis: Analysis, console: Console | None = None) -> None:
    """Print the per-step oracle bound and the prefix breakers."""
    console = console or Console()
    table = Table(title=f"analyze {analysis.spec} → {analysis.target_id[:12]}",
                  title_justify="left")
    # "@" is the step's position on the run (RUN@N), tool calls included.
    for name in ("@", "step", "prompt", "oracle", "oracle hit", "shared w/ previous"):
        table.add_column(name, justify="left" if name == "step" else "right")
    for s in analysis.steps:
        table.add_row(str(s.depth), s.step_id[:12], str(s.prompt_tokens), str(s.oracle_tokens),
                      f"{100 * s.oracle_hit_rate:.1f}%",
                      "" if s.shared_with_previous is None else str(s.shared_with_previous))
    console.print(table)
    total = analysis.prompt_tokens
    rate = analysis.oracle_tokens / total if total else 0.0
    console.print(f"oracle bound: {analysis.oracle_tokens}/{total} prompt tokens "
                  f"({100 * rate:.1f}%)")
    if not analysis.breakers:
        console.print("no prefix breakers: every prompt extends the previous context")
    depth = {s.index: s.depth for s in analysis.steps}
    for b in analysis.breakers:
        console.print(
            f"[bold]step @{depth[b.index]}[/bold] ({b.step_id[:12]}) breaks the prefix at token "
            f"{b.token_position} (char {b.char_position}), {b.lost_tokens} tokens lost: "
            f"[bold]{b.cause}[/bold] — {b.explanation}",
            highlight=False,
        )
        console.print(f"    …{b.before!r} | previous: {b.previous!r} | now: {b.current!r}",
                      highlight=False, markup=False)
