"""Function-calling runs (tool_calls, role "tool", tools) analyze and replay like any other.

Real parts: a real SQLite store, trajectories in the shapes tau-bench and
mini-swe-agent v2 write (fixtures made here, imported with kvtrace's own
importer), tiny random models built from a config — one with the default
SmolLM2 template (which knows only role and content: the fallback rendering)
and one whose template renders tools itself — and the default model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace.engine import KVCache, build_tiny_model, load_engine
from kvtrace.formats import import_document
from kvtrace.replay import LocalBackend, analyze, replay
from kvtrace.replay.recording import prompt_ids, response_text

DATA = Path(__file__).resolve().parent.parent / "data"
TRAJECTORIES = ["openai_tau_airline.json", "openai_mini_swe_agent_v2.json"]

# A ChatML template that renders tools and tool calls itself, written for these
# tests in the style of Hermes/Qwen templates (tool calls as <tool_call> JSON).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "You can call these tools:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}"
    "{%- elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tools_engine(tmp_path_factory, default_model_folder):
    """A tiny random model whose chat template supports tools."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tools-model")
    folder = build_tiny_model(root / "tiny-tools", tokenizer_dir=default_model_folder, seed=3,
                              num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return load_engine(folder, cache_dir=root / "cache")


def _with_tools(document):
    """The conversation with a `tools` list declaring every function it calls, as the
    request carried it (harness logs often keep the tools apart from the messages)."""
    messages = document if isinstance(document, list) else document["messages"]
    tools: dict[str, dict] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            function = call["function"]
            properties = {key: {"type": "string"} for key in json.loads(function["arguments"])}
            tools.setdefault(function["name"], {"type": "function", "function": {
                "name": function["name"], "description": f"The {function['name']} tool.",
                "parameters": {"type": "object", "properties": properties}}})
    return {"messages": messages, "tools": list(tools.values())}


def _import(store, name: str, run: str):
    document = _with_tools(json.loads((DATA / name).read_text()))
    import_document(store, document, format="openai", run=run)
    return store.path(run)


def _imported_calls(store, name: str, run: str):
    return [s for s in _import(store, name, run) if s.kind == "model_call"]


def test_fixtures_are_function_calling_conversations_of_at_least_ten_calls(replay_store):
    for index, name in enumerate(TRAJECTORIES):
        path = _import(replay_store, name, f"shape-{index}")
        calls = [s for s in path if s.kind == "model_call"]
        assert len(calls) >= 10
        assert any(s.content["response"].get("tool_calls") for s in calls)
        if "tau" in name:  # tau-bench's tool-calling turns have no text
            assert any(s.content["response"]["content"] is None for s in calls)
        assert any(m["role"] == "tool" for m in calls[-1].content["messages"])
        assert calls[0].content["messages"][0]["role"] == "system"
        tool_steps = [s for s in path if s.kind == "tool_call"]
        assert tool_steps and all(s.meta.get("call_id") for s in tool_steps)


def test_the_fallback_renders_tools_tool_calls_and_tool_turns(replay_store, tiny_engine):
    assert not tiny_engine.supports_tools  # the default SmolLM2 template
    calls = _imported_calls(replay_store, TRAJECTORIES[1], "fb")
    last = calls[-1]
    text = tiny_engine.decode(prompt_ids(tiny_engine, last), skip_special_tokens=False)
    tool_names = [t["function"]["name"] for t in last.content["tools"]]
    assert "# Tools" in text and all(f'"name": "{n}"' in text for n in tool_names)
    assert "<|im_start|>tool\n" in text
    assert text.count("<tool_call>") >= len(calls) - 1  # the tools header shows one too
    call = next(s for s in calls if s.content["response"].get("tool_calls"))
    rendered = response_text(call)
    function = call.content["response"]["tool_calls"][0]["function"]
    assert rendered.startswith("<tool_call>\n") and f'"name": "{function["name"]}"' in rendered
    assert json.loads(rendered.split("\n")[1])["arguments"] == json.loads(function["arguments"])


@pytest.mark.parametrize("name", TRAJECTORIES)
@pytest.mark.parametrize("which", ["fallback", "native"])
def test_rebuild_of_a_function_calling_run_hits_the_oracle_bound(
    replay_store, tiny_engine, tools_engine, tmp_path, name, which
):
    engine = tiny_engine if which == "fallback" else tools_engine
    assert engine.supports_tools == (which == "native")
    _import(replay_store, name, "fc")
    analysis = analyze(replay_store, "fc", engine)
    backend = LocalBackend(engine, KVCache(engine, disk_dir=tmp_path / "kv"))
    report = replay(replay_store, "fc", backend, mode="rebuild")
    total = report.total
    assert len(report.steps) >= 10
    assert total.reused_tokens == total.oracle_tokens == analysis.oracle_tokens
    assert total.oracle_tokens > 0.5 * total.prompt_tokens  # prompts extend each other
    assert [s.prompt_tokens for s in report.steps] == [s.prompt_tokens for s in analysis.steps]


def test_native_template_gets_the_tools_and_the_calls(replay_store, tools_engine):
    calls = _imported_calls(replay_store, TRAJECTORIES[1], "nt")
    text = tools_engine.decode(prompt_ids(tools_engine, calls[-1]), skip_special_tokens=False)
    assert "You can call these tools:" in text and "<tool_response>" in text
    assert "# Tools" not in text  # the fallback is not used when the template knows tools


def test_analyze_shows_the_providers_cached_tokens(replay_store, tiny_engine):
    document = json.loads((DATA / TRAJECTORIES[0]).read_text())
    _import(replay_store, TRAJECTORIES[0], "plain")  # no usage recorded
    assert analyze(replay_store, "plain", tiny_engine).provider is None
    run = replay_store.run("with-usage")
    messages = document if isinstance(document, list) else document["messages"]
    cached = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        usage = {"prompt_tokens": 100 * index, "cached_tokens": 64 * index}
        cached.append(usage["cached_tokens"])
        run.record_model_call(messages[:index], message, model="gpt-4o", usage=usage)
    provider = analyze(replay_store, "with-usage", tiny_engine).provider
    assert provider is not None and provider.cached_tokens == sum(cached)
    assert provider.num_calls == len(cached)


def test_a_prompt_longer_than_the_context_is_said_at_the_start_and_what_fits_replays(
        replay_store, tiny_engine, tmp_path):
    """Issue 41, item 8: said before any work, the steps that fit replayed and reported, a
    `stopped` entry with the tokens needed as prompt + response."""
    from dataclasses import replace

    _import(replay_store, TRAJECTORIES[0], "long")
    short = replace(tiny_engine, max_context_tokens=600)
    analysis = analyze(replay_store, "long", short)
    marked = [s for s in analysis.steps if s.context_problem]
    assert marked and "more than the model's context of 600" in marked[0].context_problem
    assert "(prompt " in marked[0].context_problem and " + response " in marked[0].context_problem
    first = marked[0]
    fitting = [s for s in analysis.steps if s.depth < first.depth]
    backend = LocalBackend(short, KVCache(short, disk_dir=tmp_path / "kv"))
    with pytest.warns(UserWarning, match=rf"stopped at @{first.depth} .*: replaying the "
                                         rf"{len(fitting)} model calls before it"):
        report = replay(replay_store, "long", backend, mode="rebuild")
    assert [s.depth for s in report.steps] == [s.depth for s in fitting]
    stopped = report.stopped
    assert stopped is not None and (stopped.depth, stopped.context) == (first.depth, 600)
    assert stopped.needed > 600 and stopped.prompt_tokens == first.prompt_tokens
    assert stopped.num_skipped == len(analysis.steps) - len(fitting)
    assert report.to_dict()["stopped"]["needed_tokens"] == stopped.needed


def test_the_cli_prints_the_steps_that_fit_then_where_it_stopped_and_exits_1(
        replay_store, tmp_path, capsys):
    from kvtrace.cli import main
    from kvtrace.engine.folders import default_model_dir
    from kvtrace.paths import default_cache_dir

    folder = build_tiny_model(tmp_path / "short", tokenizer_dir=default_model_dir(
        default_cache_dir()), seed=3)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 600}))
    _import(replay_store, TRAJECTORIES[0], "long")
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", replay_store.url, "replay", "long", "--model", str(folder),
              "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1
    assert "warning: stopped at @" in err and "model calls before it" in err  # at the start
    table, _, last = out.partition("stopped at @")
    assert "rebuild long" in table  # the report of the steps that fit, then where it stopped
    assert "(prompt " in last and "context of 600" in " ".join(last.split())


CALC_TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "Facts about a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]


def _shot(index: int, question: str, name: str, arguments: dict, result: str, answer: str):
    call_id = f"call_shot{index}"
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": answer},
    ]


@pytest.mark.slow
def test_verify_of_a_generated_function_calling_run_and_of_an_edited_fork(
    replay_store, default_engine, tmp_path
):
    """The default model (fallback rendering) calls tools; verify agrees with its own
    run, and names the step whose tool-call arguments a fork edited."""
    from kvtrace.replay.continuation import continue_run
    from kvtrace.replay.tools import DEMO_TOOLS

    messages = [
        {"role": "system", "content": "You answer questions by calling tools."},
        *_shot(1, "What is 17 times 4?", "calculator", {"expression": "17*4"}, "68", "68"),
        *_shot(2, "Which country is Rome in?", "lookup", {"city": "Rome"},
               '{"city": "Rome", "country": "Italy"}', "Italy"),
        {"role": "user", "content": "How many people live in Paris?"},
    ]
    backend = LocalBackend(default_engine, KVCache(default_engine, disk_dir=tmp_path / "kv"))
    continue_run(replay_store, "fc", backend, steps=2, tools=DEMO_TOOLS, messages=messages,
                 tool_definitions=CALC_TOOLS)
    path = replay_store.path("fc")
    asked = [s for s in path if s.kind == "model_call" and s.content["response"].get("tool_calls")]
    assert asked, "the default model called no tool: the fixture prompt no longer works"
    assert any(s.kind == "tool_call" and s.meta["call_id"] for s in path)

    report = replay(replay_store, "fc", backend, mode="verify")
    assert report.total.first_mismatch is None
    assert all(s.is_match for s in report.steps)

    target = asked[-1]
    response = json.loads(json.dumps(target.content["response"]))
    function = response["tool_calls"][0]["function"]
    function["arguments"] = json.dumps({"edited": "by a supervisor"})
    if target.depth > 1:
        fork = replay_store.fork(f"fc@{target.depth - 1}", "fc-edit")
    else:
        fork = replay_store.run("fc-edit")
    fork.record_model_call(target.content["messages"], response, model="SmolLM2-135M-Instruct",
                           tools=CALC_TOOLS)
    edited = replay(replay_store, "fc-edit", backend, mode="verify")
    bad = [s for s in edited.steps if not s.is_match]
    assert [s.depth for s in bad] == [target.depth]
    assert bad[0].mismatch is not None and "arguments" in (bad[0].mismatch.tool_call or "")
    assert '"edited"' in bad[0].mismatch.tool_call


@pytest.mark.slow
def test_the_default_model_rebuilds_an_imported_function_calling_run_at_the_oracle_bound(
    replay_store, default_engine, tmp_path
):
    assert not default_engine.supports_tools  # SmolLM2's template: the fallback rendering
    _import(replay_store, TRAJECTORIES[1], "swe")
    analysis = analyze(replay_store, "swe", default_engine)
    backend = LocalBackend(default_engine, KVCache(default_engine, disk_dir=tmp_path / "kv"))
    report = replay(replay_store, "swe", backend, mode="rebuild")
    assert len(report.steps) >= 10
    assert report.total.reused_tokens == report.total.oracle_tokens == analysis.oracle_tokens


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("atif_*.json")))
def test_imported_atif_trajectories_replay_at_the_oracle_bound(
    replay_store, tiny_engine, tmp_path, name
):
    import_document(replay_store, json.loads((DATA / name).read_text()), format="atif",
                    run="atif")
    analysis = analyze(replay_store, "atif", tiny_engine)
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine, disk_dir=tmp_path / "kv"))
    report = replay(replay_store, "atif", backend, mode="rebuild")
    assert report.steps and report.total.reused_tokens == report.total.oracle_tokens
    assert report.total.oracle_tokens == analysis.oracle_tokens


def test_a_store_of_the_version_1_encoding_replays_and_verifies(tiny_engine, tmp_path):
    """Steps written before message-level storage load, replay and verify after migration."""
    import shutil

    from kvtrace import open_store

    path = tmp_path / "old.db"
    shutil.copy(Path(__file__).resolve().parent.parent / "store" / "data" / "store_v1.db", path)
    store = open_store(f"sqlite:///{path}")
    backend = LocalBackend(tiny_engine, KVCache(tiny_engine, disk_dir=tmp_path / "kv"))
    rebuild = replay(store, "old", backend, mode="rebuild")
    assert len(rebuild.steps) == 3
    assert rebuild.total.reused_tokens == rebuild.total.oracle_tokens
    verify = replay(store, "old", backend, mode="verify")
    assert len(verify.steps) == 3 and all(s.is_match is not None for s in verify.steps)
    assert store.fsck().is_ok
    store.close()


@pytest.mark.parametrize(("second", "cause"), [("reversed", "reordered_list"),
                                               ("changed", "changed_tools")])
def test_analyze_names_a_tool_list_that_changes_between_calls(replay_store, byte_tokenizer,
                                                             second, cause):
    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
    later = list(reversed(tools)) if second == "reversed" else [tools[0]]
    run = replay_store.run("t")
    question = [{"role": "user", "content": "q"}]
    first = run.record_model_call(question, "one", model="m", tools=tools)
    run.record_model_call([*question, first.content["response"],
                           {"role": "user", "content": "more"}], "two", model="m", tools=later)
    (breaker,) = analyze(replay_store, "t", byte_tokenizer).breakers
    assert breaker.cause == cause
