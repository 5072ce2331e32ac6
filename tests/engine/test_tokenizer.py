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


@pytest.mark.slow
def test_a_first_analyze_converts_the_tokenizer_alone_and_says_so_once(
    default_engine, tmp_path, monkeypatch, capsys
):
    """Issue 23, item 12: analyze needs no weights, so a fresh cache gets no 517 MB model."""
    from kvtrace import open_store
    from kvtrace.cli import main

    url = f"sqlite:///{tmp_path / 's.db'}"
    with open_store(url) as store:
        store.run("agent").record_model_call(MESSAGES[:2], "144", model="m")
    fresh = tmp_path / "cache"
    monkeypatch.setenv("KVTRACE_CACHE", str(fresh))

    def analyze():
        with pytest.raises(SystemExit) as exit_info:
            main(["--store", url, "analyze", "agent", "--json"])
        out = capsys.readouterr()
        assert exit_info.value.code == 0, out.err
        return out.err

    said = analyze().splitlines()
    assert len(said) == 1 and said[0].startswith("kvtrace: ") and "tokenizer" in said[0]
    assert "once" in said[0] and "weights" in said[0]
    assert not (fresh / "models").exists() and not list(fresh.rglob("*.safetensors"))
    assert analyze() == ""  # converted once

    announced: list[str] = []
    tokenizer = load_tokenizer(cache_dir=fresh, on_convert=announced.append)
    assert announced == [] and tokenizer.path.parent == fresh / "tokenizers"
    assert tokenizer.chat_tokens(MESSAGES) == default_engine.chat_tokens(MESSAGES)
    assert tokenizer.eos_token_ids == default_engine.eos_token_ids
    assert tokenizer.max_context_tokens == default_engine.max_context_tokens


def test_a_converted_model_folder_serves_its_tokenizer(tiny_folder, tmp_path):
    """Once the whole model is converted, its folder is the tokenizer's: no second copy."""
    from kvtrace.engine.folders import DEFAULT_MODEL_NAME, tokenizer_folder

    converted = tmp_path / "models" / DEFAULT_MODEL_NAME
    shutil.copytree(tiny_folder, converted)
    assert tokenizer_folder(None, tmp_path, on_convert=pytest.fail) == converted
