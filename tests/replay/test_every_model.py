"""Replay, verify, fork and serve with models whose layers are not all full attention.

Real agent logs (the Claude Code session and the Codex rollout in tests/data)
replayed on tiny random models of a hybrid family (Jamba: Mamba + attention
+ experts) and a sliding-window family (Gemma 3): the cache reuses exactly
the oracle bound at the model's resume points, the report gives both
bounds, and a fork continues warm. The local server answers an agent's
requests with such a model too, reporting the reused tokens.
"""

from __future__ import annotations

import httpx
import pytest

from kvtrace.engine import default_model_dir, load_engine
from kvtrace.engine.families import write_family
from kvtrace.paths import default_cache_dir
from kvtrace.replay import replay
from tests.replay.test_agent_logs import ROLLOUT, SESSION, _import

FAMILIES = ["jamba", "gemma3"]


@pytest.fixture(scope="module")
def family_engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    tokenizer = default_model_dir(default_cache_dir())
    return {name: load_engine(write_family(name, root / name, tokenizer_dir=tokenizer, seed=5),
                              cache_dir=root / "cache") for name in FAMILIES}


@pytest.fixture
def logs(replay_store):
    _import(replay_store, "claude-code", SESSION, "cc")
    _import(replay_store, "codex", ROLLOUT, "cx")
    return replay_store


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("run", ["cc", "cx"])
def test_rebuild_reuses_the_oracle_at_the_models_resume_points(logs, family_engines,
                                                               local_backend_factory, tmp_path,
                                                               name, run):
    backend = local_backend_factory(family_engines[name], kv_dir=tmp_path / "kv")
    report = replay(logs, run, backend, mode="rebuild")
    steps = report.steps
    assert [s.reused_tokens for s in steps] == [s.oracle_resume_tokens for s in steps]
    assert all(s.oracle_resume_tokens % backend.resume_every == 0 for s in steps)
    assert all(s.oracle_resume_tokens <= s.oracle_tokens for s in steps)
    total = report.total
    assert total.oracle_resume_tokens < total.oracle_tokens  # block boundaries cost a little
    assert total.hit_rate == total.oracle_resume_hit_rate > 0.4
    warm = replay(logs, run, backend, mode="rebuild")
    assert warm.total.hit_rate > 0.9


def test_verify_regenerates_with_a_hybrid_model(logs, family_engines, local_backend_factory,
                                                tmp_path):
    backend = local_backend_factory(family_engines["jamba"], kv_dir=tmp_path / "kv")
    cold = replay(logs, "cx", backend.without_cache(), mode="verify", use_drafts=False)
    warm = replay(logs, "cx", backend, mode="verify", use_drafts=False)
    # A random model answers nonsense, the same nonsense with the cache as without it.
    assert [s.is_match for s in warm.steps] == [s.is_match for s in cold.steps]
    assert warm.total.reused_tokens > 0


def test_the_local_server_answers_with_a_window_model(family_engines, local_backend_factory,
                                                      kvtrace_serve, tmp_path):
    backend = local_backend_factory(family_engines["gemma3"], kv_dir=tmp_path / "kv")
    server = kvtrace_serve(backend)
    history = [{"role": "system", "content": "You are a careful agent. " * 30},
               {"role": "user", "content": "List the files, then read README.md."}]
    usages = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for turn in range(2):
            reply = client.post("/chat/completions", json={
                "model": "any", "messages": history, "max_tokens": 4, "temperature": 0})
            assert reply.status_code == 200, reply.text
            body = reply.json()
            usages.append(body["usage"])
            history += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                        {"role": "user", "content": f"Go on, step {turn + 2}."}]
    first, second = usages
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached % 64 == 0 and cached >= first["prompt_tokens"] - 64 > 0


def test_a_fork_with_an_edited_tool_result_continues_warm(store, family_engines,
                                                          local_backend_factory, tmp_path):
    """The Claude Code session rebuilt on a hybrid model, forked at a tool result with an edit,
    then continued: the continued call resumes at a kept resume point before the edit."""
    from kvtrace.replay import SamplingParams, continue_run
    from kvtrace.replay.oracle import common_prefix_length
    from kvtrace.replay.recording import prompt_ids
    from kvtrace.store import kinds

    engine = family_engines["jamba"]
    _import(store, "claude-code", SESSION, "cc")
    backend = local_backend_factory(engine, kv_dir=tmp_path / "kv")
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
    sent = engine.chat_tokens(kinds.ModelCall(result.new_steps[0]).messages)
    edit_at = common_prefix_length(sent, prompt_ids(engine, after.step))
    assert 0 < report.reused_tokens <= edit_at and report.reused_tokens % 64 == 0
    assert report.computed_tokens == len(sent) - report.reused_tokens


def test_branches_run_together_on_a_window_model(store, family_engines, local_backend_factory,
                                                 tmp_path):
    from kvtrace.replay import SamplingParams, branch_out

    engine = family_engines["gemma3"]
    _import(store, "codex", ROLLOUT, "cx")
    backend = local_backend_factory(engine, kv_dir=tmp_path / "kv")
    report = branch_out(store, "cx", backend, n=3, steps=1, tools={},
                        params=SamplingParams(max_new_tokens=3, temperature=0.7), seed=1)
    assert len(report.branches) == 3
    assert all(len(store.path(b.run)) == len(store.path("cx")) + 1 for b in report.branches)
