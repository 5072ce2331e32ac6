"""Claude Code session transcripts in and out: calls, tool results, a subagent, the file back."""

from __future__ import annotations

import io
import itertools
import json
import shutil

import pytest

from kvtrace.cli import main
from kvtrace.errors import UsageError
from kvtrace.formats import (
    export_claude_code,
    export_file,
    import_claude_code,
    import_file,
    read_session,
    subagent_runs,
)
from kvtrace.store import ProviderApi, kinds
from tests.formats.conftest import DATA, state

SESSION = "6f1c3b2e-8d4a-4c1e-9b7f-2a5d8e0c4f13"
AGENT = "a5c21e7"
MAIN = DATA / "claude_code" / f"{SESSION}.jsonl"
SUB = DATA / "claude_code" / SESSION / "subagents" / f"agent-{AGENT}.jsonl"


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _import(store, run="cc", path=MAIN):
    return import_file(store, io.BytesIO(path.read_bytes()), format="claude-code", run=run,
                       filename=str(path))


def _tool_results(lines):
    return [block for line in lines if line.get("type") == "user"
            and isinstance(line["message"]["content"], list)
            for block in line["message"]["content"] if block.get("type") == "tool_result"]


def test_each_api_response_is_one_model_call_spoken_in_the_messages_api(store):
    info = _import(store)
    path = store.path("cc")
    calls = kinds.model_calls(path)
    lines = _lines(MAIN)
    responses = {line["message"]["id"] for line in lines if line.get("type") == "assistant"}
    assert info.depth == len(path) and len(calls) == len(responses) == 31
    assert all(call.api is ProviderApi.ANTHROPIC_MESSAGES for call in calls)
    assert calls[0].native["messages"] == [{"role": "user", "content": lines[2]["message"][
        "content"]}]
    assert calls[0].model == "claude-sonnet-4-5-20250929"
    # The third response was written as four lines (thinking, text, two tool_use): one call.
    parallel = calls[2].native["response"]
    assert [b["type"] for b in parallel["content"]] == ["thinking", "text", "tool_use",
                                                        "tool_use"]
    assert parallel["stop_reason"] == "tool_use"
    assert parallel["content"][0]["signature"].startswith("Eq")
    # Its two tool results were two user lines: one user message of the next call.
    assert [b["type"] for b in calls[3].native["messages"][-1]["content"]] == [
        "tool_result", "tool_result"]


def test_every_call_sends_the_conversation_before_it_and_extends_the_previous_one(store):
    _import(store)
    calls = kinds.model_calls(store.path("cc"))
    for before, call in itertools.pairwise(calls):
        sent = before.native["messages"]
        assert call.native["messages"][: len(sent)] == sent
        answer = call.native["messages"][len(sent)]
        assert answer == {"role": "assistant", "content": before.native["response"]["content"]}
    assert calls[17].native["messages"][-1]["content"].startswith("Thanks. Could you also")


def test_usage_is_the_providers_own_and_cache_reads_grow(store):
    _import(store)
    calls = kinds.model_calls(store.path("cc"))
    last_lines = {}
    for line in _lines(MAIN):
        if line.get("type") == "assistant":
            last_lines[line["message"]["id"]] = line["message"]["usage"]
    assert [c.raw_usage for c in calls] == list(last_lines.values())
    reads = [c.usage.cached_tokens for c in calls]
    assert reads == sorted(reads) and reads[0] == 0 and reads[-1] > 15_000
    first = calls[1].usage
    raw = calls[1].raw_usage
    assert first.prompt_tokens == (raw["input_tokens"] + raw["cache_read_input_tokens"]
                                   + raw["cache_creation_input_tokens"])
    assert first.cache_write_tokens == raw["cache_creation_input_tokens"]


def test_each_tool_result_is_a_tool_call_after_the_call_that_asked(store):
    _import(store)
    path = store.path("cc")
    tools = kinds.tool_calls(path)
    results = _tool_results(_lines(MAIN))
    assert len(tools) == len(results) == 30
    asked = {}
    for step in path:
        if step.kind == kinds.StepKind.MODEL_CALL:
            for block in kinds.ModelCall(step).native["response"]["content"]:
                if block["type"] == "tool_use":
                    asked[block["id"]] = (step.depth, block)
        else:
            depth, block = asked[kinds.ToolCall(step).call_id]
            assert depth < step.depth
            assert kinds.ToolCall(step).tool == block["name"]
            assert kinds.ToolCall(step).arguments == block["input"]
    assert [t.result for t in tools] == [r["content"] for r in results]


def test_progress_snapshot_summary_and_system_lines_are_kept_not_called(store):
    _import(store)
    path = store.path("cc")
    first = kinds.ModelCall(path[0]).extra["claude_code"]
    assert [line["type"] for line in first["before"]] == ["summary", "file-history-snapshot",
                                                          "user"]
    progress = [line for step in path for line in kinds.view(step).extra.get(
        "claude_code", {}).get("before", []) if line["type"] == "progress"]
    assert len(progress) == sum(1 for line in _lines(MAIN) if line["type"] == "progress") > 10
    assert kinds.view(path[-1]).extra["claude_code"]["after"][-1]["type"] == "system"


def test_the_subagent_is_its_own_run_linked_to_the_task_that_started_it(store):
    _import(store)
    (agent,) = subagent_runs(store, "cc")
    assert agent.name == f"cc/agent-{AGENT}"
    sub_path = store.path(agent.name)
    sub_calls = kinds.model_calls(sub_path)
    assert len(sub_calls) == 4 and len(sub_path) == 7
    assert sub_calls[0].model == "claude-haiku-4-5-20251001"
    link = sub_calls[0].extra["claude_code"]["parent"]
    task = next(t for t in kinds.tool_calls(store.path("cc")) if t.step.id == link["step"])
    assert task.tool == "Task" and task.call_id == link["tool_use_id"]
    prompt = sub_calls[0].native["messages"][0]["content"]
    assert prompt == task.arguments["prompt"]
    # The Task's result is the subagent's last answer.
    final = sub_calls[-1].native["response"]["content"][-1]["text"]
    assert task.result[0]["text"] == final


def test_export_gives_back_the_session_and_the_subagent_files(store, tmp_path):
    _import(store)
    assert export_claude_code(store, "cc") == _lines(MAIN)
    assert export_claude_code(store, f"cc/agent-{AGENT}") == _lines(SUB)
    target = tmp_path / "back.jsonl"
    with target.open("wb") as file:
        export_file(store, "cc", file, format="claude-code")
    assert [json.loads(line) for line in target.read_text().splitlines()] == _lines(MAIN)


def test_importing_the_export_gives_the_same_steps(store, tmp_path):
    _import(store)
    back = tmp_path / "back" / f"{SESSION}.jsonl"
    (back.parent / SESSION / "subagents").mkdir(parents=True)
    back.write_text("".join(json.dumps(line) + "\n" for line in export_claude_code(store, "cc")))
    (back.parent / SESSION / "subagents" / f"agent-{AGENT}.jsonl").write_text("".join(
        json.dumps(line) + "\n" for line in export_claude_code(store, f"cc/agent-{AGENT}")))
    _import(store, "again", back)
    assert [s.id for s in store.path("again")] == [s.id for s in store.path("cc")]
    assert store.head(f"again/agent-{AGENT}").id == store.head(f"cc/agent-{AGENT}").id


def test_subagent_files_of_the_older_layout_sit_beside_the_session(store, tmp_path):
    shutil.copy(MAIN, tmp_path / MAIN.name)
    shutil.copy(SUB, tmp_path / SUB.name)
    other = _lines(SUB)
    for line in other:
        line["sessionId"] = "another-session"
    (tmp_path / "agent-b000001.jsonl").write_text("".join(json.dumps(x) + "\n" for x in other))
    _import(store, "old", tmp_path / MAIN.name)
    assert [info.name for info in subagent_runs(store, "old")] == [f"old/agent-{AGENT}"]


def test_a_fork_with_an_edited_result_exports_the_edit_and_imports_back(store):
    _import(store)
    path = store.path("cc")
    tool = next(t for t in kinds.tool_calls(path) if t.tool == "Bash"
                and "pytest" in t.arguments["command"])
    asked = kinds.ModelCall(path[tool.step.depth - 2])
    fork = store.fork(f"cc@{tool.step.depth}", "cc-edit", edit={"result": "1 failed\n"})
    fork.record_model_call(
        [*asked.native["messages"],
         {"role": "assistant", "content": asked.native["response"]["content"]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.call_id,
                                       "content": "1 failed\n"}]}],
        {"role": "assistant", "content": [{"type": "text", "text": "It fails."}]},
        model="claude-sonnet-4-5-20250929", api="anthropic-messages")
    lines = export_claude_code(store, "cc-edit")
    edited = lines[-2]["message"]["content"][0]
    assert edited == {"tool_use_id": tool.call_id, "type": "tool_result", "content": "1 failed\n"}
    assert lines[-2]["parentUuid"] == lines[-3]["uuid"]  # chained to the line before
    assert lines[-1]["parentUuid"] == lines[-2]["uuid"]
    import_claude_code(store, lines, run="cc-edit-back")
    back = store.path("cc-edit-back")
    assert kinds.ToolCall(back[-2]).result == "1 failed\n"
    assert kinds.ModelCall(back[-1]).native["messages"][-1]["content"][0]["content"] == (
        "1 failed\n")


# -- bad input: one error naming the line; nothing recorded ----------------------------------


def _broken(tmp_path, change):
    lines = MAIN.read_text().splitlines(keepends=True)
    lines = change(lines)
    path = tmp_path / "broken.jsonl"
    path.write_text("".join(lines))
    return path


def _with_uuid_of(first: str, line: str) -> str:
    """`line` given the uuid of `first` (found by the import property test: a parentUuid
    naming two lines imported one conversation, and its export another)."""
    return json.dumps({**json.loads(line), "uuid": json.loads(first)["uuid"]}) + "\n"


def _tool_result_line(lines):
    return next(i for i, line in enumerate(lines) if '"tool_result"' in line)


def test_a_line_written_twice_is_one_line_and_imports(store, tmp_path):
    path = _broken(tmp_path, lambda ls: [*ls[:3], ls[2], *ls[3:]])  # the first prompt
    _import(store, "twice", path)
    _import(store, "once", MAIN)
    assert [step.content for step in store.path("twice")] == [
        step.content for step in store.path("once")]


@pytest.mark.parametrize(("case", "change", "message"), [
    ("truncated last line", lambda ls: [*ls[:-1], ls[-1][: len(ls[-1]) // 2]],
     r"broken\.jsonl line 107 is not JSON: .* \(a truncated line\?\)"),
    ("malformed line", lambda ls: [*ls[:5], "{not json}\n", *ls[5:]],
     r"broken\.jsonl line 6 is not JSON"),
    ("line not an object", lambda ls: [*ls[:5], "[1, 2]\n", *ls[5:]],
     r"broken\.jsonl line 6 is not a JSON object"),
    ("tool_result answering nothing", lambda ls: [
        *ls[:_tool_result_line(ls)],
        ls[_tool_result_line(ls)].replace('"tool_use_id":"toolu_01', '"tool_use_id":"toolu_99'),
        *ls[_tool_result_line(ls) + 1:]],
     r"broken\.jsonl line \d+: content\[0\] is a tool_result for 'toolu_99\w+', which answers "
     r"no tool_use of an earlier assistant line"),
    ("assistant content not blocks", lambda ls: [
        ls[0], ls[1], ls[2], ls[3].replace('"content":[', '"content":"oops","x":['), *ls[4:]],
     r"broken\.jsonl line 4: an assistant message's content must be a list"),
    ("no model call", lambda ls: ls[:3], r"broken\.jsonl has no assistant message"),
    ("a uuid on two different lines", lambda ls: [*ls[:4], _with_uuid_of(ls[3], ls[4]), *ls[5:]],
     r"broken\.jsonl line 5: uuid '[\w-]+' is also the uuid of line 4, a different line"),
])
def test_a_bad_transcript_is_one_error_naming_its_line_and_writes_nothing(
        store, tmp_path, case, change, message):
    path = _broken(tmp_path, change)
    before = state(store)
    with pytest.raises(UsageError, match=message):
        _import(store, "bad", path)
    assert state(store) == before


def test_a_bad_subagent_file_refuses_the_whole_session(store, tmp_path):
    shutil.copytree(DATA / "claude_code", tmp_path / "cc")
    sub = tmp_path / "cc" / SESSION / "subagents" / f"agent-{AGENT}.jsonl"
    sub.write_text(sub.read_text()[:-40])
    before = state(store)
    with pytest.raises(UsageError, match=rf"agent-{AGENT}\.jsonl line 13 is not JSON"):
        _import(store, "bad", tmp_path / "cc" / MAIN.name)
    assert state(store) == before


def test_a_session_passed_as_parsed_lines_imports_without_its_subagents(store):
    info = import_claude_code(store, _lines(MAIN), run="lines")
    assert info.depth == 61 and subagent_runs(store, "lines") == []
    session = read_session(MAIN.read_bytes(), str(MAIN))
    assert len(session.subagents) == 1


def _kv(store_url, capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", store_url, *argv])
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_the_cli_imports_the_session_and_names_its_subagent(store_url, capsys, tmp_path):
    code, out, _ = _kv(store_url, capsys, "import", "--format", "claude-code", str(MAIN),
                       "--run", "cc")
    assert code == 0
    assert out.splitlines() == ["imported cc (61 steps)",
                                f"imported cc/agent-{AGENT} (7 steps), a subagent of cc"]
    code, out, _ = _kv(store_url, capsys, "import", "-f", "claude-code", str(MAIN), "--run",
                       "cc2", "--json")
    data = json.loads(out)
    assert code == 0 and data["name"] == "cc2"
    assert [s["name"] for s in data["subagents"]] == [f"cc2/agent-{AGENT}"]
    target = tmp_path / "out.jsonl"
    assert _kv(store_url, capsys, "export", "cc", "-f", "claude-code", "-o", str(target))[0] == 0
    assert [json.loads(x) for x in target.read_text().splitlines()] == _lines(MAIN)


def test_the_cli_refuses_a_truncated_transcript_in_one_line_exit_2(store, store_url, capsys,
                                                                  tmp_path):
    path = _broken(tmp_path, lambda ls: [*ls[:-1], ls[-1][:40]])
    before = state(store)
    code, out, err = _kv(store_url, capsys, "import", "--format", "claude-code", str(path),
                         "--run", "x")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: ") and "broken.jsonl line 107 is not JSON" in err
    assert err.rstrip().endswith("(a truncated line?)")
    assert state(store) == before
