"""Prompts encoded a piece at a time give the ids of the whole text encoded at once.

`chat_tokens` renders the chat template, then encodes the text a segment at a
time (kvtrace/engine/segments.py); these compare it with the tokenizer's own
`apply_chat_template(tokenize=True)` on the default model's tokenizer, for
agent conversations and for arbitrary text (special-token text in content
too), and check that a tokenizer whose pieces are not encoded independently
is encoded whole.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.bench.conversations import agent_document
from kvtrace.engine import load_tokenizer
from kvtrace.engine.segments import encoder_for
from kvtrace.paths import default_cache_dir


@pytest.fixture(scope="module")
def chat() -> Any:
    return load_tokenizer(None, cache_dir=default_cache_dir())


def _whole(chat: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The ids as the tokenizer gives them for the whole rendered text."""
    from kvtrace.rendering import template_messages

    rendered, tools = template_messages(messages, kwargs.pop("tools", None),
                                    native=chat.supports_tools)
    encoded = chat.tokenizer.apply_chat_template(rendered, tools=tools, tokenize=True,
                                                 return_dict=True, **kwargs)
    return [int(t) for t in encoded["input_ids"]]


def test_the_default_tokenizer_is_encoded_a_piece_at_a_time(chat):
    assert encoder_for(chat.tokenizer) is not None


@pytest.mark.parametrize("shape", ["tau", "swe"])
def test_every_prompt_of_an_agent_run_has_the_ids_of_its_whole_text(chat, shape):
    document = agent_document(12, seed=5, shape=shape)
    messages = document["messages"]
    for end in range(2, len(messages) + 1):  # each prompt extends the one before
        prompt = messages[:end]
        assert chat.chat_tokens(prompt, tools=document["tools"]) == _whole(
            chat, prompt, tools=document["tools"], add_generation_prompt=True)
    assert chat.chat_tokens(messages, add_generation_prompt=False) == _whole(
        chat, messages, add_generation_prompt=False)


_PARTS = st.sampled_from([*"ab \n\t.,:;'\"{}[]()<>|_-=+é中😀\u200b\r",
                          "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im", "_start|>",
                          "  ", "\n\n", "assistant", "user"])
_TEXT = st.lists(_PARTS, max_size=30).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contents=st.lists(_TEXT, min_size=1, max_size=5))
def test_any_text_has_the_ids_of_the_whole(chat, contents):
    roles = ["system", "user", "assistant", "user", "assistant"]
    messages = [{"role": roles[i], "content": text} for i, text in enumerate(contents)]
    assert chat.chat_tokens(messages) == _whole(chat, messages, add_generation_prompt=True)
    encoder = encoder_for(chat.tokenizer)
    text = "".join(contents)
    assert encoder is not None and encoder.encode(text) == [
        int(t) for t in chat.tokenizer(text, add_special_tokens=False)["input_ids"]]


def _word_tokenizer(pre_tokenizer: Any) -> Any:
    """A tiny word-level tokenizer (no hub) with `<s>` as a special token."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "▁a": 2, "a": 3, "▁b": 4, "b": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                   additional_special_tokens=["<s>"])


def test_a_tokenizer_that_prepends_at_the_start_only_is_encoded_whole():
    from tokenizers import pre_tokenizers

    tokenizer = _word_tokenizer(pre_tokenizers.Metaspace(prepend_scheme="first"))
    # Piece by piece would differ here: "a" after <s> is not at the start of the text.
    alone = tokenizer.encode("a", add_special_tokens=False)
    assert tokenizer.encode("a<s>a", add_special_tokens=False) != [*alone, 1, *alone]
    assert encoder_for(tokenizer) is None


def test_a_special_token_that_strips_spaces_does_not_split():
    from tokenizers import AddedToken, pre_tokenizers

    tokenizer = _word_tokenizer(pre_tokenizers.Whitespace())
    tokenizer.add_special_tokens({"additional_special_tokens": [
        AddedToken("<x>", lstrip=True, special=True), AddedToken("<y>", special=True)]})
    encoder = encoder_for(tokenizer)
    assert encoder is not None and "<x>" not in encoder.split_tokens
    assert {"<s>", "<y>"} <= set(encoder.split_tokens)
    for text in ("a <x> b<y>a", "<y><x>  a", "b", "a<s> b <y>"):
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_split_tokens_that_clash_are_found_as_pair_by_pair_would():
    """`_overlapping` (by sets, for tokenizers with thousands of added tokens) against the
    definition: another token contains it, it contains another, or their ends overlap."""
    import random

    from kvtrace.engine.segments import _overlapping

    def clash(a: str, b: str) -> bool:
        return a in b or b in a or any(a.endswith(b[:k]) or b.endswith(a[:k])
                                       for k in range(1, min(len(a), len(b))))

    rng = random.Random(0)
    for _ in range(300):
        texts = list({"".join(rng.choice("<>|ab_") for _ in range(rng.randint(1, 7)))
                      for _ in range(rng.randint(2, 25))})
        candidates = {t: i for i, t in enumerate(texts) if rng.random() < 0.7}
        expected = {a for a in candidates if any(clash(a, b) for b in texts if b != a)}
        assert _overlapping(texts, candidates) == expected
