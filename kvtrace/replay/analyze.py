"""Why prompts miss the cache, found with the tokenizer alone (no forward pass).

For every model call on the path to a step: the oracle bound (see oracle.py),
what the recording's provider read from its cache and wrote to it (its
usage, read through `Usage`: the one parser of every provider's names), and
with a price list (prices.py) what the call cost as billed and without the
cache; and whether the prompt extends the previous call's context (its prompt and
output). A call that does not is a **prefix breaker**: every token of the
previous context after the break point must be computed again. For each
breaker, analyze gives the token and character position, a snippet of both
sides, and names the likely cause by comparing the two calls' messages:

- ``timestamp``: a date or time changed inside a message (typically the
  system prompt), so everything after it misses;
- ``changing_number``: some other number changed (a counter, an id);
- ``reordered_list``: the same lines or items in another order (a tool list
  built from an unordered set, say), in a message or in the request's `tools`;
- ``changed_tools``: the request's tool definitions changed between calls;
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

import json
import re
from dataclasses import dataclass
from typing import Any

from kvtrace.errors import ReplayError
from kvtrace.rendering import assistant_text
from kvtrace.replay.backend import Message, Tokenizer
from kvtrace.replay.oracle import PrefixOracle, common_prefix_length
from kvtrace.replay.prices import Cost, Costs, Prices
from kvtrace.replay.recording import (
    check_context,
    expected_output_ids,
    prompt_ids,
    response_message,
    step_messages,
    step_tools,
    templated_output_ids,
)
from kvtrace.store import Step, Store
from kvtrace.store.kinds import ModelCall, StepKind

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
    provider_prompt_tokens: int | None = None  # as the recording's provider counted them
    provider_cached_tokens: int | None = None  # read from its cache; None: not reported
    context_problem: str | None = None  # set when prompt + output exceed the model's context
    provider_cache_write_tokens: int | None = None  # written to its cache; None: not reported
    provider_completion_tokens: int | None = None
    model: str | None = None
    cost: Cost | None = None  # with a price list, when the model has a price and counts
    has_system_prompt: bool = True  # whether the recorded prompt starts with a system turn

    @property
    def oracle_hit_rate(self) -> float:
        return self.oracle_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def provider_hit_rate(self) -> float | None:
        """The fraction of its prompt the provider read from its cache (None: not reported)."""
        if self.provider_cached_tokens is None or not self.provider_prompt_tokens:
            return None
        return self.provider_cached_tokens / self.provider_prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        rate = self.provider_hit_rate
        return {
            "index": self.index,
            "step_id": self.step_id,
            "depth": self.depth,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "oracle_tokens": self.oracle_tokens,
            "oracle_hit_rate": round(self.oracle_hit_rate, 6),
            "shared_with_previous": self.shared_with_previous,
            "provider_prompt_tokens": self.provider_prompt_tokens,
            "provider_cached_tokens": self.provider_cached_tokens,
            "provider_cache_write_tokens": self.provider_cache_write_tokens,
            "provider_completion_tokens": self.provider_completion_tokens,
            "provider_hit_rate": None if rate is None else round(rate, 6),
            "cost_billed": None if self.cost is None else self.cost.billed,
            "cost_uncached": None if self.cost is None else self.cost.uncached,
            "context_problem": self.context_problem,
        }


@dataclass(frozen=True, slots=True)
class Analysis:
    """Oracle bound per model call and the prefix breakers of a run."""

    spec: str
    target_id: str
    steps: list[StepAnalysis]
    breakers: list[PrefixBreaker]
    is_priced: bool = False  # analyzed with a price list

    @property
    def costs(self) -> Costs | None:
        """The run's cost with and without the cache (None: analyzed without prices)."""
        if not self.is_priced:
            return None
        priced = [s for s in self.steps if s.cost is not None]
        return Costs(
            num_calls=len(priced),
            billed=sum(s.cost.billed for s in priced if s.cost),
            uncached=sum(s.cost.uncached for s in priced if s.cost),
            unpriced_models=sorted({s.model or "unknown" for s in self.steps
                                    if s.cost is None and s.provider_prompt_tokens is not None}),
            num_unknown=sum(1 for s in self.steps if s.provider_prompt_tokens is None),
        )

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.steps)

    @property
    def oracle_tokens(self) -> int:
        return sum(s.oracle_tokens for s in self.steps)

    @property
    def provider(self) -> ProviderCache | None:
        """The provider's own cache figures, over the calls that report them (None: none do)."""
        known = [s for s in self.steps if s.provider_cached_tokens is not None
                 and s.provider_prompt_tokens]
        if not known:
            return None
        writes = [s.provider_cache_write_tokens for s in known
                  if s.provider_cache_write_tokens is not None]
        return ProviderCache(
            num_calls=len(known),
            prompt_tokens=sum(s.provider_prompt_tokens or 0 for s in known),
            cached_tokens=sum(s.provider_cached_tokens or 0 for s in known),
            oracle_hit_rate=sum(s.oracle_tokens for s in known)
            / max(1, sum(s.prompt_tokens for s in known)),
            cache_write_tokens=sum(writes) if writes else None,
            num_write_calls=len(writes),
            num_without_system=sum(1 for s in known if not s.has_system_prompt),
        )

    def to_dict(self) -> dict[str, Any]:
        total = self.prompt_tokens
        provider = self.provider
        costs = self.costs
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
                "context_problems": sum(1 for s in self.steps if s.context_problem),
            },
            "provider": provider.to_dict() if provider else None,
            "cost": costs.to_dict() if costs else None,
        }


@dataclass(frozen=True, slots=True)
class ProviderCache:
    """What the recording's provider reported reusing, beside the oracle bound.

    The provider counts in its own tokenizer, so the comparison is of rates:
    its cached fraction against the fraction an exact-prefix cache could reuse.
    """

    num_calls: int
    prompt_tokens: int
    cached_tokens: int  # read from the provider's cache
    oracle_hit_rate: float
    # Written to it, summed over the `num_write_calls` calls that say; None: none says
    # (Codex, DeepSeek): unknown, never 0.
    cache_write_tokens: int | None = None
    num_write_calls: int = 0
    num_without_system: int = 0  # of `num_calls`, those whose recorded prompt has no system turn

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def note(self) -> str | None:
        """Why the provider read more than the bound, where it did (the bound is no lie: it
        counts what the log holds, and the provider saw more)."""
        if self.hit_rate <= self.oracle_hit_rate:
            return None
        if self.num_without_system:
            return (f"the provider read more than the bound because {self.num_without_system} "
                    f"of these {self.num_calls} calls hold no system prompt in this log (a "
                    "Claude Code transcript keeps neither it nor the tool list sent), which "
                    "the provider's cache held too; the bound covers what the log holds")
        return ("the provider read more than the bound: it counts in its own tokenizer, and "
                "its requests may hold what this log leaves out (a system prompt, the tools)")

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_calls": self.num_calls,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "cache_write_calls": self.num_write_calls,
            "hit_rate": round(self.hit_rate, 6),
            "oracle_hit_rate": round(self.oracle_hit_rate, 6),
            "calls_without_system_prompt": self.num_without_system,
            "note": self.note,
        }


def analyze(store: Store, spec: str, tokenizer: Tokenizer, *,
            prices: Prices | None = None) -> Analysis:
    """The oracle bound and the prefix breakers of the run (or step) `spec`.

    With `prices`, each call's cost as billed and without the cache (prices.py).
    """
    path = store.path(spec)
    if not path:
        raise ReplayError(f"{spec!r} has no steps to analyze: record a model call on it first")
    model_steps = [s for s in path if s.kind == StepKind.MODEL_CALL]
    oracle = PrefixOracle()
    steps: list[StepAnalysis] = []
    breakers: list[PrefixBreaker] = []
    previous: tuple[Step, list[int], list[int]] | None = None  # step, prompt ids, output ids
    for index, step in enumerate(model_steps, start=1):
        prompt = prompt_ids(tokenizer, step)
        output = expected_output_ids(step, tokenizer, prompt)
        shared: int | None = None
        if previous is not None:
            context = previous[1] + previous[2]
            shared = common_prefix_length(prompt, context)
            if shared < len(context):
                breakers.append(_breaker(index, step, prompt, previous, shared, tokenizer))
        call = ModelCall(step)
        usage = call.usage
        steps.append(StepAnalysis(
            index, step.id, step.depth, len(prompt), oracle.bound(prompt), shared,
            usage.prompt_tokens, usage.cached_tokens,
            check_context(tokenizer, step, len(prompt), len(output)),
            provider_cache_write_tokens=usage.cache_write_tokens,
            provider_completion_tokens=usage.completion_tokens, model=call.model,
            cost=prices.cost(call.model, usage) if prices is not None else None,
            has_system_prompt=_has_system_prompt(step_messages(step))))
        oracle.add(prompt + output, label=step.id)
        previous = (step, prompt, output)
    return Analysis(spec, path[-1].id, steps, breakers, is_priced=prices is not None)


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
    old_tools, new_tools = step_tools(prev_step) or [], step_tools(step) or []
    if old_tools != new_tools and at < len(prev_prompt):
        if sorted(map(_key, old_tools)) == sorted(map(_key, new_tools)):
            return ("reordered_list", "the same tools in another order; sort the tool list so "
                    "that it renders identically every call", None)
        return ("changed_tools", "the request's tool definitions changed; keep the tool list "
                "stable across calls (tools render at the start of the prompt)", None)
    now = step_messages(step)
    prev_response = response_message(prev_step)
    before = [*step_messages(prev_step), prev_response]
    k = next((i for i, (a, b) in enumerate(zip(before, now, strict=False)) if a != b), None)
    if k is None:
        if len(now) < len(before):
            return ("messages_removed", "the prompt leaves out the previous response", None)
        if at >= len(prev_prompt):
            templated = templated_output_ids(tokenizer, step_messages(prev_step),
                                             prev_response, prev_prompt,
                                             tools=step_tools(prev_step))
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


def _has_system_prompt(messages: list[Any]) -> bool:
    return bool(messages) and isinstance(messages[0], dict) and (
        messages[0].get("role") in ("system", "developer"))


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _text_of(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Decoded with special tokens kept: positions then count the rendered prompt."""
    return tokenizer.decode(ids, skip_special_tokens=False)


def _text(message: Message) -> str:
    return assistant_text(message)


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
