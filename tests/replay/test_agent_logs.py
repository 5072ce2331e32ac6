"""The agents' own logs, imported: analyze against the provider's cache, rebuild, fork warm.

A Claude Code session (31 calls, a subagent) and a Codex rollout, imported
from tests/data, each analyzed (what the provider read from its cache and
wrote to it, beside the oracle bound) and replayed in rebuild mode on a tiny
random model, where the cache reuses exactly the oracle bound. A fork whose
tool result is edited (Store.fork with an edit, the Anthropic step normalised
by store/edits.py) continues warm: only the tokens after the edit are computed.
"""

from __future__ import annotations

import io
import json

import pytest

from kvtrace.cli import main
from kvtrace.formats import import_file
from kvtrace.replay import SamplingParams, analyze, continue_run, replay
from kvtrace.replay.oracle import common_prefix_length
from kvtrace.replay.prices import parse_prices
from kvtrace.replay.recording import prompt_ids
from kvtrace.store import kinds
from tests.formats.conftest import DATA

SESSION = DATA / "claude_code" / "6f1c3b2e-8d4a-4c1e-9b7f-2a5d8e0c4f13.jsonl"
SUBAGENT = "cc/agent-a5c21e7"
ROLLOUT = next((DATA / "codex").glob("rollout-*.jsonl"))
PRICES = {"models": {
    "claude-sonnet-4-5": {"input": 3, "output": 15, "cache_read": 0.3, "cache_write": 3.75},
    "gpt-5.1-codex": {"input": 1.25, "output": 10, "cache_read": 0.125},
}}


def _import(store, fmt, path, run):
    return import_file(store, io.BytesIO(path.read_bytes()), format=fmt, run=run,
                       filename=str(path))


@pytest.fixture
def logs(replay_store):
    """A SQLite store holding the Claude Code session (cc, its subagent) and the rollout (cx)."""
    _import(replay_store, "claude-code", SESSION, "cc")
    _import(replay_store, "codex", ROLLOUT, "cx")
    return replay_store


@pytest.mark.parametrize("run", ["cc", SUBAGENT, "cx"])
def test_analyze_sets_the_providers_cache_reads_and_writes_beside_the_oracle(
        logs, byte_tokenizer, run):
    result = analyze(logs, run, byte_tokenizer, prices=parse_prices(PRICES))
    calls = kinds.model_calls(logs.path(run))
    assert len(result.steps) == len(calls)
    for step, call in zip(result.steps, calls, strict=True):
        assert step.provider_prompt_tokens == call.usage.prompt_tokens
        assert step.provider_cached_tokens == call.usage.cached_tokens
        assert step.provider_cache_write_tokens == call.usage.cache_write_tokens
    provider = result.provider
    assert provider is not None and provider.num_calls == len(calls)
    assert provider.cached_tokens == sum(c.usage.cached_tokens or 0 for c in calls)
    written = [c.usage.cache_write_tokens for c in calls if c.usage.cache_write_tokens is not None]
    # Unknown is None, never 0 (issue 41, item 4): a Codex rollout does not say what it wrote.
    assert provider.cache_write_tokens == (sum(written) if written else None)
    assert provider.num_write_calls == len(written)
    assert (run == "cx") == (provider.cache_write_tokens is None)
    assert 0.5 < provider.hit_rate < 1 and 0.4 < provider.oracle_hit_rate < 1
    total = result.to_dict()
    assert total["provider"]["cache_write_tokens"] == provider.cache_write_tokens
    assert total["provider"]["cache_write_calls"] == len(written)


def test_costs_as_billed_and_without_the_cache_add_up_per_step(logs, byte_tokenizer):
    prices = parse_prices(PRICES)
    result = analyze(logs, "cc", byte_tokenizer, prices=prices)
    costs = result.costs
    assert costs is not None and costs.num_calls == 31 and costs.unpriced_models == []
    assert costs.billed == pytest.approx(sum(s.cost.billed for s in result.steps if s.cost))
    assert costs.uncached > 2 * costs.billed  # a session reads most of its prompt from cache
    sub = analyze(logs, SUBAGENT, byte_tokenizer, prices=prices).costs
    assert sub is not None and sub.num_calls == 0 and sub.unpriced_models == [
        "claude-haiku-4-5-20251001"]
    assert analyze(logs, "cc", byte_tokenizer).costs is None
    assert analyze(logs, "cc", byte_tokenizer).to_dict()["cost"] is None


def test_the_cli_prints_the_costs_with_a_prices_file(logs, tmp_path, capsys,
                                                     default_model_folder):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(PRICES))
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", logs.url, "analyze", "cx", "--prices", str(prices), "--json"])
    assert exit_info.value.code in (0, None)
    data = json.loads(capsys.readouterr().out)
    assert data["cost"]["num_calls"] == 12 and data["cost"]["saved"] > 0
    assert data["steps"][1]["provider_cached_tokens"] > 0
    assert data["provider"]["cache_write_tokens"] is None  # the rollout does not say: not 0
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", logs.url, "analyze", "cx", "--prices", str(prices)])
    assert ", wrote unknown, on the 12 calls" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", logs.url, "analyze", "cx", "--prices", str(tmp_path / "no.json")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: --prices ") and "cannot read it" in err


@pytest.mark.parametrize("run", ["cc", SUBAGENT, "cx"])
def test_rebuild_reuses_exactly_the_oracle_bound(logs, tiny_engine, local_backend_factory,
                                                 tmp_path, run):
    report = replay(logs, run, local_backend_factory(tiny_engine, kv_dir=tmp_path / "kv"),
                    mode="rebuild")
    assert len(report.steps) == len(kinds.model_calls(logs.path(run)))
    assert [s.reused_tokens for s in report.steps] == [s.oracle_tokens for s in report.steps]
    assert report.total.hit_rate == report.total.oracle_hit_rate > 0.4
    oracle = analyze(logs, run, tiny_engine)
    assert [s.oracle_tokens for s in report.steps] == [s.oracle_tokens for s in oracle.steps]


def test_thinking_is_not_rendered_but_kept_in_the_step(logs, tiny_engine):
    calls = kinds.model_calls(logs.path("cc"))
    thinking = calls[0].native["response"]["content"][0]
    assert thinking["type"] == "thinking"
    assert calls[0].response["reasoning_content"] == thinking["thinking"]
    text = tiny_engine.decode(prompt_ids(tiny_engine, calls[1].step))
    assert thinking["thinking"] not in text


def test_a_fork_with_an_edited_tool_result_continues_warm(store, tiny_engine,
                                                          local_backend_factory, tmp_path):
    _import(store, "claude-code", SESSION, "cc")
    backend = local_backend_factory(tiny_engine, kv_dir=tmp_path / "kv")
    replay(store, "cc", backend, mode="rebuild")
    path = store.path("cc")
    tool = next(t for t in kinds.tool_calls(path) if t.tool == "Bash"
                and t.arguments["command"] == "python -m pytest -q tests")
    after = next(kinds.ModelCall(s) for s in path[tool.step.depth:]
                 if s.kind == kinds.StepKind.MODEL_CALL)
    store.fork(f"cc@{tool.step.depth}", "cc-edit", edit={"result": "F.\n1 failed in 0.04s\n"})

    result = continue_run(store, "cc-edit", backend, steps=1, tools={},
                          params=SamplingParams(max_new_tokens=4))
    (report,) = result.reports
    sent = tiny_engine.chat_tokens(kinds.ModelCall(result.new_steps[0]).messages)
    original = prompt_ids(tiny_engine, after.step)  # the parent's call after the tool
    edit_at = common_prefix_length(sent, original)
    assert len(sent) - 40 < edit_at < len(sent)  # the edit is near the end
    assert report.reused_tokens == edit_at  # the parent's later prompt, rebuilt, is cached
    assert report.computed_tokens == len(sent) - edit_at
    # The parent run is untouched; the fork shares every step before the edit.
    assert store.head("cc").id == path[-1].id
    assert [s.id for s in store.path("cc-edit")[: tool.step.depth - 1]] == [
        s.id for s in path[: tool.step.depth - 1]]


def test_a_fork_editing_an_anthropic_tool_result_block_replays_warm(
        store, tiny_engine, local_backend_factory, tmp_path):
    _import(store, "claude-code", SESSION, "cc")
    path = store.path("cc")
    call = kinds.model_calls(path)[10]
    messages = json.loads(json.dumps(call.native["messages"]))
    block = messages[-1]["content"][0]
    assert block["type"] == "tool_result"
    block["content"] = "edited output"
    store.fork(f"cc@{call.step.depth}", "cc-block", edit={"messages": messages})
    edited = kinds.ModelCall(store.head("cc-block"))
    assert edited.edit_of == call.step.id and edited.native["messages"] == messages

    backend = local_backend_factory(tiny_engine, kv_dir=tmp_path / "kv")
    replay(store, "cc", backend, mode="rebuild")
    report = replay(store, "cc-block", backend, mode="rebuild")
    shared, last = report.steps[:-1], report.steps[-1]
    assert [s.computed_tokens for s in shared] == [1] * len(shared)  # each prompt's last token
    edit_at = common_prefix_length(prompt_ids(tiny_engine, edited.step),
                                   prompt_ids(tiny_engine, call.step))
    assert last.reused_tokens == edit_at
    assert last.computed_tokens == last.prompt_tokens - edit_at


def test_analyze_says_why_a_provider_beats_the_bound_on_a_log_without_its_system_prompt(
        logs, replay_store, byte_tokenizer, capsys, default_model_folder):
    """Issue 41, item 13: a Claude Code transcript keeps no system prompt; the provider cached
    it, so its hit rate can pass the log's bound, and analyze says why."""
    cc = analyze(logs, "cc", byte_tokenizer).provider
    assert cc is not None and cc.num_without_system == cc.num_calls  # none in the transcript
    run = replay_store.run("no-system")
    asked = [{"role": "user", "content": "Fix the failing test in tests/test_app.py."}]
    answer = {"role": "assistant", "content": "Looking."}
    run.record_model_call(asked, answer, model="claude-sonnet-4-5",
                          usage={"prompt_tokens": 4000, "cached_tokens": 3900})
    run.record_model_call([*asked, answer, {"role": "user", "content": "Go on."}], "Done.",
                          model="claude-sonnet-4-5",
                          usage={"prompt_tokens": 4050, "cached_tokens": 4000})
    result = analyze(replay_store, "no-system", byte_tokenizer)
    provider = result.provider
    assert provider is not None and provider.hit_rate > provider.oracle_hit_rate
    assert provider.num_without_system == 2 and "no system prompt" in provider.note
    assert result.to_dict()["provider"]["note"] == provider.note
    with pytest.raises(SystemExit):
        main(["--store", replay_store.url, "analyze", "no-system"])
    out = " ".join(capsys.readouterr().out.split())
    assert "note: the provider read more than the bound because 2 of these 2 calls" in out


@pytest.mark.parametrize("columns", [80, 160])
def test_analyze_and_log_read_at_the_terminals_width_and_never_cut_a_number(
        logs, byte_tokenizer, capsys, monkeypatch, columns, default_model_folder):
    """Issue 41, item 10: every line fits; each number of the table is whole; a wider
    terminal shows more columns."""
    monkeypatch.setenv("COLUMNS", str(columns))
    prices = json.dumps(PRICES)
    path = logs.url.removeprefix("sqlite:///") + ".prices.json"
    with open(path, "w") as fh:
        fh.write(prices)
    with pytest.raises(SystemExit):
        main(["--store", logs.url, "analyze", "cx", "--prices", path])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns
    numbers = [str(s.prompt_tokens) for s in analyze(logs, "cx", byte_tokenizer).steps]
    table = out.split("oracle bound:")[0]
    rows = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == len(numbers)
    assert all("…" not in cell for row in rows for cell in row)
    assert ("step" in table) == (columns == 160)  # the ids go first when room runs out
    with pytest.raises(SystemExit):
        main(["--store", logs.url, "log", "cx"])
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(line) for line in lines) <= columns
