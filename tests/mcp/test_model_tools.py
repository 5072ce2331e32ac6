"""The tools that compute with the server's model (`kvtrace mcp --model`, a tiny random Llama):
analyze, replay (rebuild and verify) and branch, over stdio on a real store."""

from __future__ import annotations

import json

import pytest

from kvtrace import open_store
from tests.agent_runs import record_calc_run
from tests.mcp.conftest import cli


@pytest.fixture
def calc(sqlite_url, name):
    with open_store(sqlite_url) as store:
        record_calc_run(store.run(name), question=f"What is 17 * 23? ({name})")
    return name


def test_analyze_is_the_analyze_command_json(sqlite_client, sqlite_url, calc, tiny_model,
                                             capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    analysis = sqlite_client.call("analyze", run=calc)
    code, out, err = cli(capsys, sqlite_url, "analyze", calc, "--model", str(tiny_model),
                         "--json")
    assert code == 0, err
    assert analysis == json.loads(out)
    assert [s["depth"] for s in analysis["steps"]] == [1, 3]
    assert 0 < analysis["total"]["oracle_tokens"] < analysis["total"]["prompt_tokens"]


def test_a_second_rebuild_reuses_the_kv_the_first_left_in_the_server(sqlite_client, calc):
    first = sqlite_client.call("replay", run=calc)
    assert first["mode"] == "rebuild" and first["run"] == calc
    assert [s["depth"] for s in first["steps"]] == [1, 3]
    second = sqlite_client.call("replay", run=calc)
    total = second["total"]
    assert total["prompt_tokens"] == first["total"]["prompt_tokens"]
    # Everything but each prompt's last token (always computed) comes from the cache.
    assert total["reused_tokens"] == total["prompt_tokens"] - 2
    assert total["computed_tokens"] == 2


def test_verify_gives_a_verdict_for_every_model_call(sqlite_client, calc):
    verified = sqlite_client.call("replay", run=calc, mode="verify", to=f"{calc}@1")
    assert verified["mode"] == "verify" and len(verified["steps"]) == 1
    # A random model does not say what was recorded: the first step differs, and says where.
    assert verified["steps"][0]["match"] is False
    assert verified["steps"][0]["mismatch"]["position"] == 0
    assert verified["total"]["first_mismatch"] == 1


def test_branch_forks_n_runs_from_a_step_and_continues_each(client, stores, name):
    with open_store(stores) as store:
        record_calc_run(store.run(name), question=f"What is 17 * 23? ({name})")
    report = client.call("branch", spec=f"{name}@2", n=2, steps=1, max_new_tokens=4,
                         prefix=f"{name}-try", seed=3)
    assert report["fork_depth"] == 2 and not report["edited"]
    assert [b["run"] for b in report["branches"]] == [f"{name}-try-1", f"{name}-try-2"]
    assert [b["seed"] for b in report["branches"]] == [3, 4]
    with open_store(stores) as store:
        for branch in report["branches"]:
            path = store.path(branch["run"])
            assert len(path) == 2 + branch["steps"] and path[1].id == store.resolve(f"{name}@2")
        assert store.head(name).depth == 3  # the branched run is untouched


def test_branch_with_an_edit_starts_every_branch_from_the_edited_step(client, stores, name):
    with open_store(stores) as store:
        record_calc_run(store.run(name), question=f"What is 17 * 23? ({name})")
    report = client.call("branch", spec=f"{name}@2", n=1, steps=1, max_new_tokens=4,
                         edit={"result": "392"})
    assert report["edited"]
    with open_store(stores) as store:
        fork_step = store.show(report["fork_step"])
        assert fork_step.content["result"] == "392" and fork_step.depth == 2


def test_replay_sends_progress_to_a_client_that_asks_for_it(sqlite_client, calc):
    seen: list[tuple[float, float | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total))

    result = sqlite_client.run(sqlite_client.session.call_tool(
        "replay", {"run": calc}, progress_callback=on_progress))
    assert not result.is_error and result.structured_content["total"]["steps"] == 2
    assert seen == [(1, 2), (2, 2)]  # model calls replayed, of all
