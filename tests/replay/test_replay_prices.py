"""Price lists: what a call cost as billed and without the provider's cache."""

from __future__ import annotations

import json

import pytest

from kvtrace.errors import UsageError
from kvtrace.replay.prices import Cost, parse_prices, read_prices
from kvtrace.store import Usage

SONNET = {"input": 3.0, "output": 15.0, "cache_read": 0.3, "cache_write": 3.75}


def test_anthropic_usage_is_billed_by_its_four_counts():
    prices = parse_prices({"models": {"claude-sonnet-4-5": SONNET}})
    usage = Usage.parse({"input_tokens": 3, "cache_read_input_tokens": 20_000,
                         "cache_creation_input_tokens": 1_000, "output_tokens": 400})
    cost = prices.cost("claude-sonnet-4-5-20250929", usage)  # priced by its longest prefix
    assert cost == Cost(billed=(3 * 3.0 + 20_000 * 0.3 + 1_000 * 3.75 + 400 * 15.0) / 1e6,
                        uncached=(21_003 * 3.0 + 400 * 15.0) / 1e6)
    assert cost.saved > 0


def test_openai_usage_counts_its_cached_tokens_inside_the_input():
    prices = parse_prices({"models": {"gpt-5.1-codex": {"input": 1.25, "output": 10,
                                                        "cache_read": 0.125}}})
    usage = Usage.parse({"input_tokens": 10_000, "cached_input_tokens": 8_192,
                         "output_tokens": 100})
    cost = prices.cost("gpt-5.1-codex", usage)
    assert cost is not None
    assert cost.billed == pytest.approx((1_808 * 1.25 + 8_192 * 0.125 + 100 * 10) / 1e6)
    assert cost.uncached == pytest.approx((10_000 * 1.25 + 100 * 10) / 1e6)


def test_cache_prices_default_to_the_input_price_and_unknowns_cost_nothing_known():
    prices = parse_prices({"models": {"m": {"input": 2, "output": 4}}})
    assert prices.models["m"].cache_read == prices.models["m"].cache_write == 2.0
    usage = Usage.parse({"prompt_tokens": 100, "cached_tokens": 60, "completion_tokens": 1})
    cost = prices.cost("m", usage)
    assert cost is not None and cost.billed == cost.uncached
    assert prices.cost("other", usage) is None  # no price
    assert prices.cost("m", Usage()) is None  # no counts: unknown, not 0
    assert prices.price("m-large") is prices.models["m"]
    longer = parse_prices({"models": {"m": {"input": 1, "output": 1},
                                      "m-large": {"input": 9, "output": 9}}})
    assert longer.price("m-large-2") is longer.models["m-large"]


def test_json_and_toml_files_read_the_same(tmp_path):
    as_json = tmp_path / "prices.json"
    as_json.write_text(json.dumps({"models": {"claude-sonnet-4-5": SONNET}}))
    as_toml = tmp_path / "prices.toml"
    as_toml.write_text('[models."claude-sonnet-4-5"]\ninput = 3.0\noutput = 15.0\n'
                       "cache_read = 0.3\ncache_write = 3.75\n")
    assert read_prices(as_json) == read_prices(as_toml)


@pytest.mark.parametrize(("document", "says"), [
    ({}, "must map models to prices"),
    ({"models": []}, "must map models to prices"),
    ({"models": {"m": 3}}, "models.m must be an object of prices"),
    ({"models": {"m": {"input": 1}}}, r"models.m.output must be a price per million tokens"),
    ({"models": {"m": {"input": -1, "output": 1}}}, r"models.m.input must be a price"),
    ({"models": {"m": {"input": True, "output": 1}}}, r"models.m.input must be a price"),
    ({"models": {"m": {"input": 1, "output": 1, "cached": 0.1}}},
     "models.m has 'cached': the prices are input, output, cache_read and cache_write"),
])
def test_a_bad_price_list_is_one_error_naming_the_entry(document, says):
    with pytest.raises(UsageError, match=says) as info:
        parse_prices(document)
    assert info.value.param == "prices"


def test_a_file_that_cannot_be_read_or_parsed_names_the_flag(tmp_path):
    with pytest.raises(UsageError, match=r"prices=.*missing.toml: cannot read it"):
        read_prices(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[models\n")
    with pytest.raises(UsageError, match=r"prices=.*bad.toml is not TOML"):
        read_prices(bad)
    nan = tmp_path / "nan.json"
    nan.write_text('{"models": {"m": {"input": NaN, "output": 1}}}')
    with pytest.raises(UsageError, match=r"models.m.input must be a price"):
        read_prices(nan)
