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
