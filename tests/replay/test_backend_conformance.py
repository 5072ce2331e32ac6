"""One contract, every backend: the `Backend` interface (kvtrace/replay/backend.py) as tests.

Each test runs against `LocalBackend` on a tiny random model and against
`RemoteBackend` talking to a real `kvtrace serve` (local mode, the same model,
its own KV cache) on a loopback port. What the interface promises:

- `generate` answers the prompt: text, a finish reason, `prompt_tokens` the
  length of the prompt as the model's template renders it (tools included);
  greedy is deterministic and is what the model gives uncached; `max_new_tokens`
  bounds it (a shorter greedy answer is a prefix of a longer one); a `seed`
  makes sampling reproducible; a `draft` never changes the response.
- Reuse is reported for the prompt only, at most all but its last token:
  `reused_tokens` (None when unknown), `memory_tokens + disk_tokens` when the
  tier is known, both None when it is not.
- `rebuild` leaves the prompt cached: the next call that extends it reuses it.
- `without_cache` is a backend that reuses nothing, or refuses with UsageError.
- A prompt longer than the model's context is a KvtraceError, not a crash.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvtrace.engine.sampling import SamplingParams
from kvtrace.errors import KvtraceError, UsageError
from kvtrace.replay.backend import Backend, CallRequest

CONTEXT = 256  # the conformance model's context, small so that a prompt can exceed it
GREEDY = SamplingParams(max_new_tokens=12)
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Facts about a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@dataclass
class Subject:
    """A backend under test, and the engine whose model answers behind it."""

    backend: Backend
    engine: Any

    def request(self, messages: list[dict[str, Any]] = MESSAGES,
                params: SamplingParams = GREEDY, **fields: Any) -> CallRequest:
        prompt = self.engine.chat_tokens(messages, tools=fields.get("tools"))
        return CallRequest(list(messages), prompt, params, **fields)


@pytest.fixture(scope="module")
def conformance_engine(tiny_model_factory, one_torch_thread) -> Any:
    """A tiny random Llama with the default model's tokenizer and a CONTEXT-token context."""
    from kvtrace.engine import load_engine

    folder = tiny_model_factory("conformance-model", seed=13)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "max_position_embeddings": CONTEXT}))
    return load_engine(folder, cache_dir=folder.parent / "cache")


@pytest.fixture(params=["local", "remote"])
def subject(request: pytest.FixtureRequest, conformance_engine, tmp_path,
            kvtrace_serve) -> Iterator[Subject]:
    from kvtrace.engine import KVCache
    from kvtrace.replay import RemoteBackend
    from kvtrace.replay.local import LocalBackend

    local = LocalBackend(conformance_engine, KVCache(conformance_engine, disk_dir=tmp_path / "kv"))
    if request.param == "local":
        yield Subject(local, conformance_engine)
        return
    server = kvtrace_serve(local)
    with RemoteBackend(server.url, model=local.model, tokenizer=conformance_engine) as remote:
        yield Subject(remote, conformance_engine)


def _uncached_text(engine: Any, request: CallRequest) -> str:
    from kvtrace.replay.local import LocalBackend

    return LocalBackend(engine, None).generate(request).text


def test_generate_answers_with_text_a_finish_reason_and_the_prompt_length(subject):
    result = subject.backend.generate(subject.request())
    assert isinstance(result.text, str) and result.text
    assert result.finish_reason in ("stop", "length")
    assert result.prompt_tokens == len(subject.engine.chat_tokens(MESSAGES))


def test_tools_are_part_of_the_prompt(subject):
    request = subject.request(tools=TOOLS)
    result = subject.backend.generate(request)
    assert result.prompt_tokens == len(request.prompt_ids or [])
    assert result.prompt_tokens > len(subject.engine.chat_tokens(MESSAGES))


def test_greedy_generation_is_what_the_model_gives_uncached(subject):
    request = subject.request()
    first, second = subject.backend.generate(request), subject.backend.generate(request)
    assert first.text == second.text == _uncached_text(subject.engine, request)


def test_max_new_tokens_bounds_the_answer_to_a_prefix_of_a_longer_one(subject):
    short = subject.backend.generate(subject.request(params=SamplingParams(max_new_tokens=3)))
    long = subject.backend.generate(subject.request(params=SamplingParams(max_new_tokens=24)))
    assert short.finish_reason == "length"
    assert long.text.startswith(short.text) and len(long.text) > len(short.text)
    if short.output_ids is not None:
        assert len(short.output_ids) == 3


def test_a_seed_makes_sampling_reproducible(subject):
    def sample(seed: int) -> str:
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=12)
        return subject.backend.generate(subject.request(params=params)).text

    assert sample(5) == sample(5)


def test_sampling_with_a_temperature_departs_from_greedy(subject):
    greedy = subject.backend.generate(subject.request()).text
    sampled = {subject.backend.generate(subject.request(
        params=SamplingParams(temperature=1.0, seed=seed, max_new_tokens=12))).text
        for seed in (1, 2, 3)}
    assert sampled != {greedy}


def test_a_draft_never_changes_the_response(subject):
    request = subject.request()
    greedy = _uncached_text(subject.engine, request)
    ids = subject.engine.chat_tokens([*MESSAGES, {"role": "assistant", "content": "red"}],
                                     add_generation_prompt=False)[len(request.prompt_ids or []):]
    for draft in (None, ids):
        result = subject.backend.generate(subject.request(draft_ids=draft))
        assert result.text == greedy
        assert result.draft in (None, "accepted", "rejected")


def test_a_first_prompt_on_an_empty_cache_reuses_nothing(subject):
    result = subject.backend.generate(subject.request())
    assert result.reused_tokens == 0
    assert result.computed_tokens == result.prompt_tokens


def test_a_repeated_prompt_reuses_all_but_its_last_token(subject):
    subject.backend.generate(subject.request())
    again = subject.backend.generate(subject.request())
    assert again.reused_tokens == again.prompt_tokens - 1
    assert again.computed_tokens == 1


def test_reuse_is_split_by_tier_when_known_and_not_guessed_otherwise(subject):
    subject.backend.generate(subject.request())
    result = subject.backend.generate(subject.request())
    if result.memory_tokens is None or result.disk_tokens is None:
        assert result.memory_tokens is None and result.disk_tokens is None
    else:
        assert result.memory_tokens + result.disk_tokens == result.reused_tokens


def test_a_prompt_that_extends_the_previous_one_reuses_it(subject):
    first = subject.backend.generate(subject.request())
    follow = [*MESSAGES, {"role": "assistant", "content": "Red, green and blue."},
              {"role": "user", "content": "And three more?"}]
    result = subject.backend.generate(subject.request(follow))
    assert first.prompt_tokens <= (result.reused_tokens or 0) < result.prompt_tokens


def test_rebuild_leaves_the_prompt_cached_for_the_next_call(subject):
    output = "Red, green and blue."
    ids = subject.engine.chat_tokens([*MESSAGES, {"role": "assistant", "content": output}],
                                     add_generation_prompt=False)
    request = subject.request(output_text=output, output_ids=ids[len(subject.request().prompt_ids
                                                                        or []):])
    rebuilt = subject.backend.rebuild(request)
    assert rebuilt.prompt_tokens == len(request.prompt_ids or [])
    follow = [*MESSAGES, {"role": "assistant", "content": output},
              {"role": "user", "content": "And three more?"}]
    result = subject.backend.generate(subject.request(follow))
    assert (result.reused_tokens or 0) >= rebuilt.prompt_tokens


def test_without_cache_reuses_nothing_or_refuses(subject):
    subject.backend.generate(subject.request())
    try:
        uncached = subject.backend.without_cache()
    except UsageError:
        return
    result = uncached.generate(subject.request())
    assert result.reused_tokens == 0
    assert result.text == subject.backend.generate(subject.request()).text


def test_settle_keeps_what_was_computed(subject):
    subject.backend.generate(subject.request())
    subject.backend.settle()
    assert subject.backend.generate(subject.request()).reused_tokens == (
        len(subject.request().prompt_ids or []) - 1)


def test_a_prompt_past_the_context_is_an_error(subject):
    long = [{"role": "user", "content": "colour " * CONTEXT}]
    with pytest.raises(KvtraceError, match="context"):
        subject.backend.generate(subject.request(long))


def test_name_model_and_tokenizer_describe_the_backend(subject):
    backend = subject.backend
    assert backend.name == "local" or backend.name.startswith("http://127.0.0.1:")
    assert backend.model == subject.engine.name
    if backend.name == "local":
        assert backend.tokenizer is subject.engine and backend.engine_facts is None
        return
    # kvtrace serve has /tokenize: the remote backend counts in the engine's own ids, not in
    # the tokenizer it was given (the fallback), and says so.
    assert backend.tokenizer is not subject.engine
    assert backend.engine_facts.tokens.startswith("the engine's own tokens (/tokenize")
    messages = [{"role": "user", "content": "Name a colour."}]
    answered = [*messages, {"role": "assistant", "content": "Red."}]
    assert backend.tokenizer.chat_tokens(messages) == subject.engine.chat_tokens(messages)
    assert backend.tokenizer.chat_tokens(answered, add_generation_prompt=False) == (
        subject.engine.chat_tokens(answered, add_generation_prompt=False))
    # The stop token, learned from the engine's renderings, is one of the model's own.
    stops = backend.tokenizer.eos_token_ids
    assert len(stops) == 1 and set(stops) <= set(subject.engine.eos_token_ids)

