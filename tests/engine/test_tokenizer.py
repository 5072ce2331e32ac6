"""The tokenizer alone: same ids as the engine, no weights needed."""

from __future__ import annotations

import shutil

import pytest

from kvtrace.engine import load_engine, load_tokenizer
from kvtrace.errors import ModelNotFoundError

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 times 12? Answer with a number."},
    {"role": "assistant", "content": "144"},
    {"role": "user", "content": "And 13 times 13?"},
]


def test_a_folder_without_weights_gives_the_engines_token_ids(tiny_folder, tiny_engine, tmp_path):
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_folder, weightless,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with pytest.raises(ModelNotFoundError):
        load_engine(weightless, cache_dir=tmp_path / "cache")

    tokenizer = load_tokenizer(weightless, cache_dir=tmp_path / "cache")

    assert tokenizer.chat_tokens(MESSAGES) == tiny_engine.chat_tokens(MESSAGES)
    assert tokenizer.eos_token_ids == tiny_engine.eos_token_ids
    ids = tiny_engine.chat_tokens(MESSAGES)
    assert tokenizer.decode(ids, skip_special_tokens=False) == tiny_engine.decode(
        ids, skip_special_tokens=False
    )


def test_a_missing_folder_says_what_to_pass(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model folder"):
        load_tokenizer(tmp_path / "nowhere", cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_the_default_models_tokenizer_matches_its_engine(default_engine):
    tokenizer = load_tokenizer()

    assert tokenizer.name == default_engine.name
    assert tokenizer.eos_token_ids == default_engine.eos_token_ids
    assert tokenizer.chat_tokens(MESSAGES) == default_engine.chat_tokens(MESSAGES)
