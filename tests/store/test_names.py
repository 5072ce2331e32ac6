"""Run names follow Git's ref-name rules; step addresses parse as documented."""

from __future__ import annotations

import pytest

from kvtrace.errors import InvalidNameError, InvalidSpecError
from kvtrace.store.names import Spec, parse_spec, validate_run_name


@pytest.mark.parametrize("name", ["main", "exp/temp-0.7", "run_1", "a.b", "x" * 200])
def test_valid_run_names_are_accepted(name):
    assert validate_run_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a..b",
        "has space",
        "tab\tname",
        "ctl\x01",
        "a~b",
        "a^b",
        "a:b",
        "a@b",
        "x" * 201,
        "-lead",
        "trail/",
        "end.",
        "x.lock",
        "a//b",
        "dir/.hidden",
        "q?",
        "st*r",
        "br[",
        "back\\",
    ],
)
def test_invalid_run_names_are_refused(name):
    with pytest.raises(InvalidNameError):
        validate_run_name(name)


def test_run_at_number_parses():
    assert parse_spec("main@3") == Spec(run="main", number=3)


def test_run_tilde_parses_with_default_one():
    assert parse_spec("main~2") == Spec(run="main", back=2)
    assert parse_spec("main~") == Spec(run="main", back=1)


def test_hex_word_may_be_a_run_or_an_id_prefix():
    assert parse_spec("abcdef12") == Spec(run="abcdef12", prefix="abcdef12")
    assert parse_spec("abc") == Spec(run="abc", prefix=None)


@pytest.mark.parametrize("bad", ["", "main@0", "main@x", "main~x", "bad name@1"])
def test_malformed_specs_are_refused(bad):
    with pytest.raises((InvalidSpecError, InvalidNameError)):
        parse_spec(bad)
