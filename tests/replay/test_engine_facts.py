"""A replay through a remote engine counts in the engine's own tokens and blocks.

Against real servers on loopback: `kvtrace serve` (local mode, vLLM's /tokenize
shape), and stand-ins with SGLang's and llama.cpp's endpoint shapes (tests/replay/
conftest.py; vLLM's CPU build and llama.cpp's Python server are in tests/integration).
"""

from __future__ import annotations

import json

import pytest

from kvtrace.cli import main
from kvtrace.errors import UsageError
from kvtrace.replay import RemoteBackend, replay
from kvtrace.replay.engines import counters_grown, read_counters
from kvtrace.replay.retry import NO_RETRY

SYSTEM = "You are terse. " * 6


def _answer(messages):
    return f"Final Answer: {len(messages)} messages"


def _record(store, name="r", calls=5):
    run = store.run(name)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Question: count the messages."}]
    for i in range(calls):
        run.record_model_call(list(messages), _answer(messages), model="stand-in",
                              params={"temperature": 0, "max_tokens": 64})
        messages += [{"role": "assistant", "content": _answer(messages)},
                     {"role": "user", "content": f"Observation: turn {i}"}]


class WordyTokenizer:
    """A tokenizer whose template renders more than the engine's: a 40-token preamble per
    message, as a model folder with another chat template would (the case that read 106 %)."""

    def __init__(self, inner):
        self._inner = inner
        self.eos_token_ids = inner.eos_token_ids
        self.max_context_tokens = None
        self.name = "a wordier template"

    def chat_tokens(self, messages, add_generation_prompt=True, tools=None):
        ids = []
        for message in messages:
            ids += [7] * 40 + self._inner.chat_tokens([message], False, tools)
        return ids + (self._inner.chat_tokens([], True) if add_generation_prompt else [])

    def decode(self, ids, *, skip_special_tokens=True):
        return self._inner.decode([i for i in ids if i != 7],
                                  skip_special_tokens=skip_special_tokens)


def test_another_template_never_puts_the_oracle_above_100_percent(
    replay_store, stand_in_server, byte_tokenizer
):
    _record(replay_store)
    server = stand_in_server(_answer)  # chat completions only: no tokens of its own
    report = replay(replay_store, "r", RemoteBackend(server.url,
                                                     tokenizer=WordyTokenizer(byte_tokenizer)))
    total = report.total
    assert total.oracle_prompt_tokens > total.prompt_tokens  # the template renders more
    assert total.oracle_tokens > total.prompt_tokens  # read as over 100 % before
    assert all(s.oracle_hit_rate <= 1 for s in report.steps) and total.oracle_hit_rate <= 1
    assert report.engine.tokens == "a wordier template (--tokenizer)"
    assert any("gives no token ids for chat messages" in note and "--tokenizer" in note
               for note in report.notes)


def test_sglang_shape_page_size_flush_and_the_tokenizer_fallback(
    replay_store, stand_in_server, byte_tokenizer
):
    _record(replay_store)
    server = stand_in_server(_answer, engine="sglang", page_size=16)
    server.seen.append(byte_tokenizer.chat_tokens([{"role": "system", "content": SYSTEM}]))
    report = replay(replay_store, "r", RemoteBackend(server.url, tokenizer=byte_tokenizer),
                    reset_cache=True)
    assert report.reset == "/flush_cache" and server.num_resets == 1
    assert report.steps[0].reused_tokens == 0  # the system prompt it held was flushed
    facts = report.engine
    assert (facts.block_size, facts.block_size_from) == (16, "its /get_server_info")
    assert facts.tokens.endswith("(--tokenizer)")
    assert any("HTTP 400: prompt: field required" in note for note in report.notes)
    for step in report.steps:
        assert step.reused_tokens % 16 == 0 and step.oracle_resume_tokens % 16 == 0
        assert step.oracle_resume_tokens <= step.oracle_tokens < step.oracle_resume_tokens + 16
    assert report.total.reused_tokens > 0


def test_llama_cpp_shape_renders_with_its_template_and_erases_every_slot(
    replay_store, stand_in_server
):
    _record(replay_store)
    server = stand_in_server(_answer, engine="llama.cpp")
    backend = RemoteBackend(server.url)  # no tokenizer given: the engine's is enough
    report = replay(replay_store, "r", backend, reset_cache=True, mode="verify")
    assert report.reset == "/slots/{id}?action=erase" and server.num_resets == 2
    assert report.engine.tokens.startswith("the engine's own tokens (/apply-template")
    assert report.engine.block_size == 1 and "unknown" in report.engine.block_size_from
    assert report.is_match is True  # the engine's tokens, compared token by token
    expected = [server.tokenizer.chat_tokens(r["messages"]) for r in server.requests]
    assert [s.oracle_prompt_tokens for s in report.steps] == [len(ids) for ids in expected]
    assert [s.prompt_tokens for s in report.steps] == [len(ids) for ids in expected]
    assert report.total.oracle_tokens >= report.total.reused_tokens > 0
    assert not report.notes


def test_an_engine_busy_at_first_is_asked_again_for_its_tokens(replay_store, stand_in_server):
    _record(replay_store)
    server = stand_in_server(_answer, engine="llama.cpp", busy_first=2)  # two 503s first
    report = replay(replay_store, "r", RemoteBackend(server.url), mode="verify")
    assert server.busy_first == 0
    assert report.engine.tokens.startswith("the engine's own tokens (/apply-template")
    assert report.is_match is True and not report.notes


def test_a_backend_without_retries_asks_the_engine_once(replay_store, stand_in_server):
    _record(replay_store)
    server = stand_in_server(_answer, engine="llama.cpp", busy_first=2)
    report = replay(replay_store, "r", RemoteBackend(server.url, retry=NO_RETRY), mode="verify")
    assert server.busy_first == 0  # /tokenize and /apply-template, once each
    assert report.engine.tokens is None
    assert any("503" in note and "no oracle bound" in note for note in report.notes)


def test_kvtrace_serve_tokens_a_given_block_size_and_a_refused_reset(
    replay_store, tiny_engine, kvtrace_serve, tmp_path
):
    from kvtrace.engine import KVCache
    from kvtrace.replay.local import LocalBackend

    _record(replay_store)
    server = kvtrace_serve(LocalBackend(tiny_engine, KVCache(tiny_engine,
                                                             disk_dir=tmp_path / "kv")))
    with RemoteBackend(server.url, model=tiny_engine.name, block_size=4) as backend:
        report = replay(replay_store, "r", backend, reset_cache=True)
        assert backend.engine_counters() is None  # no /metrics: no counters, and no guess
    assert report.reset is None
    assert report.notes[0].startswith("the cache was not reset:")
    assert "VLLM_SERVER_DEV_MODE" in report.notes[0]
    assert report.engine.tokens.startswith("the engine's own tokens (/tokenize")
    assert (report.engine.block_size, report.engine.block_size_from) == (
        4, "--engine-block-size")
    for step in report.steps:  # the engine's count and the oracle's agree, token for token
        assert step.oracle_prompt_tokens == step.prompt_tokens
        assert step.oracle_resume_tokens % 4 == 0
    assert report.total.reused_tokens == report.total.oracle_tokens  # kvtrace is exact
    data = report.to_dict()
    assert data["engine"]["block_size"] == 4 and data["reset"] is None
    assert data["total"]["oracle_prompt_tokens"] == data["total"]["prompt_tokens"]


def test_vllm_metrics_are_read_and_differenced():
    import httpx

    page = "\n".join([
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries",
        "# TYPE vllm:prefix_cache_queries_total counter",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0',
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 300.0',
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0',
        'vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 560.0',
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 512.0',
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="True"} 1.0',
    ])
    served = [page]

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=served[-1]) if request.url.path == "/metrics" else (
            httpx.Response(404))

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        before = read_counters(client, "http://engine")
        served.append(page.replace("1200.0", "1300.0").replace("640.0", "700.0"))
        after = read_counters(client, "http://engine")
    assert before == {"queried_tokens": 1500, "hit_tokens": 640,
                      "external_queried_tokens": 560, "external_hit_tokens": 512}
    assert counters_grown(before, after) == {"queried_tokens": 100, "hit_tokens": 60,
                                             "external_queried_tokens": 0,
                                             "external_hit_tokens": 0}
    assert counters_grown(None, after) is None


def test_bad_engine_options_are_one_line_and_exit_2(replay_store, capfd):
    with pytest.raises(UsageError, match="block size"):
        RemoteBackend("http://127.0.0.1:9/v1", block_size=0)
    for argv, says in (
        (["replay", "r", "--reset-cache"], "--reset-cache empties a remote engine's cache"),
        (["replay", "r", "--engine-block-size", "4"], "--engine-block-size is for remote"),
        (["replay", "r", "--backend", "http://127.0.0.1:9/v1", "--engine-block-size", "0"],
         "--engine-block-size"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["--store", replay_store.url, *argv])
        _, err = capfd.readouterr()
        assert exit_info.value.code == 2 and says in err


def test_cli_replay_json_carries_the_engine_and_its_reset(replay_store, stand_in_server,
                                                          capfd):
    _record(replay_store)
    server = stand_in_server(_answer, engine="sglang", page_size=8)
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", replay_store.url, "replay", "r", "--backend", server.url,
              "--reset-cache", "--json"])
    out, err = capfd.readouterr()
    assert exit_info.value.code in (0, None), err
    data = json.loads(out)
    assert data["reset"] == "/flush_cache" and data["engine"]["block_size"] == 8
    assert data["engine"]["tokens"] is None  # neither the engine's nor --tokenizer's
    assert data["total"]["oracle_tokens"] is None
    assert any("no oracle bound" in note for note in data["notes"])


def test_analyze_counts_in_the_engines_tokens(replay_store, tiny_engine, kvtrace_serve,
                                              stand_in_server, tmp_path, capfd):
    from kvtrace.engine import KVCache
    from kvtrace.replay import analyze
    from kvtrace.replay.local import LocalBackend

    _record(replay_store)
    server = kvtrace_serve(LocalBackend(tiny_engine, KVCache(tiny_engine,
                                                             disk_dir=tmp_path / "kv")))
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", replay_store.url, "analyze", "r", "--backend", server.url, "--json"])
    out, err = capfd.readouterr()
    assert exit_info.value.code in (0, None), err
    counted = json.loads(out)
    expected = analyze(replay_store, "r", tiny_engine).to_dict()  # the same tokenizer, here
    assert counted["steps"] == expected["steps"] and counted["steps"][1]["oracle_tokens"] > 0
    plain = stand_in_server(_answer)  # chat completions only: nothing to count with
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", replay_store.url, "analyze", "r", "--backend", plain.url])
    _, err = capfd.readouterr()
    assert exit_info.value.code != 0 and len(err.strip().splitlines()) == 1
    assert "gives no token ids for chat messages" in err and "--model" in err


def test_an_engine_that_answers_without_usage_is_replayed_and_said(
    replay_store, stand_in_server, byte_tokenizer
):
    _record(replay_store, calls=3)
    server = stand_in_server(_answer, reports_usage=False)
    report = replay(replay_store, "r", RemoteBackend(server.url, tokenizer=byte_tokenizer))
    assert len(report.steps) == 3  # every call replayed
    assert all(s.reused_tokens is None for s in report.steps)  # unknown, never a guess
    counted = [len(byte_tokenizer.chat_tokens(r["messages"])) for r in server.requests]
    assert [s.prompt_tokens for s in report.steps] == counted  # the tokenizer's count
    assert report.total.oracle_tokens > 0
    assert any("answered 3 of 3 calls without usage" in note for note in report.notes)


def test_a_llama_server_without_slot_save_path_says_how_to_reset(replay_store,
                                                                 stand_in_server):
    _record(replay_store, calls=2)
    server = stand_in_server(_answer, engine="llama.cpp", erase_status=501)
    report = replay(replay_store, "r", RemoteBackend(server.url), reset_cache=True)
    assert report.reset is None and server.num_resets == 0 and len(report.steps) == 2
    assert "--slot-save-path" in report.notes[0] and "HTTP 501" in report.notes[0]
