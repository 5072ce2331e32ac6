"""Write the agent-log fixtures of tests/data (run: python tests/data/make_agent_logs.py).

Made up for kvtrace's tests, in the shapes the agents write (docs/formats.md
names the sources); nothing is copied from a real log. Deterministic: the
same files every run.

- claude_code/<session>.jsonl: a Claude Code 2.1 session of 31 API calls
  (thinking blocks, one response written as several lines sharing
  `message.id`, parallel tool calls, progress, snapshot and summary lines,
  usage whose cache reads grow call by call) that starts one subagent
  (Task), whose sidechain is claude_code/<session>/subagents/agent-<id>.jsonl;
- codex/rollout-....jsonl: a Codex rollout of two user turns (reasoning with
  encrypted content, function calls, one parallel, an apply_patch custom
  tool call, token_count events after each response);
- openai_mini_swe_agent_v2_deepseek.json: the mini-swe-agent fixture with
  each assistant message keeping DeepSeek's raw response in
  `extra.response` (model, usage with `prompt_tokens_details.cached_tokens`
  and `prompt_cache_hit_tokens`).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent
SESSION = "6f1c3b2e-8d4a-4c1e-9b7f-2a5d8e0c4f13"
AGENT = "a5c21e7"
CWD = "/home/dev/csvkit-lite"
VERSION = "2.1.29"
SYSTEM_TOKENS = 15_210  # Claude Code's system prompt and tools: not in the transcript
SUB_SYSTEM_TOKENS = 4_880


def _hex(*parts: Any, size: int = 32) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:size]


def _uuid(*parts: Any) -> str:
    h = _hex(*parts)
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-a{h[17:20]}-{h[20:32]}"


def _tokens(value: Any) -> int:
    return max(1, len(json.dumps(value, ensure_ascii=False)) // 4)


def _time(seconds: float) -> str:
    minutes, rest = divmod(seconds, 60)
    return f"2026-11-20T09:{int(minutes):02d}:{rest:06.3f}Z"


# -- Claude Code ---------------------------------------------------------------------------

FILES = {
    "src/csvkit_lite/writer.py": (
        "import csv\n\n\ndef write_rows(path, header, rows):\n    \"\"\"Write rows to "
        "path as CSV.\"\"\"\n    if not rows:\n        return 0\n    with open(path, 'w', "
        "newline='') as fh:\n        out = csv.writer(fh)\n        out.writerow(header)\n"
        "        out.writerows(rows)\n    return len(rows)\n"),
    "src/csvkit_lite/table.py": (
        "from .writer import write_rows\n\n\nclass Table:\n    def __init__(self, header, "
        "rows=None):\n        self.header = list(header)\n        self.rows = list(rows or [])"
        "\n\n    def export(self, path):\n        return write_rows(path, self.header, "
        "self.rows)\n"),
    "tests/test_writer.py": (
        "from csvkit_lite.writer import write_rows\n\n\ndef test_writes_rows(tmp_path):\n    "
        "path = tmp_path / 'out.csv'\n    assert write_rows(path, ['a'], [[1], [2]]) == 2\n"
        "    assert path.read_text().splitlines() == ['a', '1', '2']\n"),
}


def _numbered(text: str) -> str:
    return "".join(f"{i:>6}\u2192{line}\n" for i, line in enumerate(text.splitlines(), 1))


# Each entry is one API response: (thinking, text, [tool uses]); tool uses are
# (name, input, result text, toolUseResult). None for the final answer's tools.
def _main_script() -> list[tuple[str | None, str | None, list[tuple[str, dict, str, dict]]]]:
    writer, table, tests = (FILES[k] for k in ("src/csvkit_lite/writer.py",
                                               "src/csvkit_lite/table.py",
                                               "tests/test_writer.py"))
    fixed = writer.replace("    if not rows:\n        return 0\n", "")

    def bash(command, out, description):
        return ("Bash", {"command": command, "description": description}, out,
                {"stdout": out, "stderr": "", "interrupted": False, "isImage": False})

    def read(path, text):
        return ("Read", {"file_path": f"{CWD}/{path}"}, _numbered(text),
                {"type": "text", "file": {"filePath": f"{CWD}/{path}", "content": text,
                                          "numLines": text.count("\n"), "startLine": 1,
                                          "totalLines": text.count("\n")}})

    def grep(pattern, out):
        return ("Grep", {"pattern": pattern, "path": CWD, "output_mode": "content", "-n": True},
                out, {"mode": "content", "numFiles": out.count("\n") + 1, "filenames": [],
                      "content": out, "numLines": out.count("\n") + 1})

    def edit(path, old, new):
        return ("Edit", {"file_path": f"{CWD}/{path}", "old_string": old, "new_string": new},
                f"The file {CWD}/{path} has been updated.",
                {"filePath": f"{CWD}/{path}", "oldString": old, "newString": new,
                 "replaceAll": False, "userModified": False})

    def todo(items):
        todos = [{"content": c, "status": s, "activeForm": c} for c, s in items]
        return ("TodoWrite", {"todos": todos}, "Todos have been modified successfully.",
                {"oldTodos": [], "newTodos": todos})

    task_prompt = ("Find every place in src/ that writes CSV output and report, for each, "
                   "whether an empty table still gets its header row. Do not edit files.")
    return [
        ("The user says exported CSV files lose their header when the table is empty. "
         "Let me plan and look at the repository layout first.", None,
         [todo([("Reproduce the missing header", "in_progress"), ("Fix the writer", "pending"),
                ("Add a regression test", "pending")])]),
        (None, None, [bash("ls -R src tests | head -40",
                           "src:\ncsvkit_lite\n\nsrc/csvkit_lite:\n__init__.py\ntable.py\n"
                           "writer.py\n\ntests:\ntest_writer.py\n", "List the source tree")]),
        ("There are two modules that matter. I will read both at once.",
         "Let me read the writer and the table class.",
         [read("src/csvkit_lite/writer.py", writer), read("src/csvkit_lite/table.py", table)]),
        ("write_rows returns early when rows is empty, before the header is written. "
         "Before changing it I want to know whether other code writes CSV too: a subagent "
         "can search while I reproduce.", None,
         [("Task", {"description": "Find CSV writers", "prompt": task_prompt,
                    "subagent_type": "Explore"}, "@SUBAGENT", {})]),
        (None, None, [bash("python -c \"from csvkit_lite.table import Table; "
                           "Table(['a','b']).export('/tmp/e.csv')\"; cat /tmp/e.csv; echo "
                           "[exit $?]", "cat: /tmp/e.csv: No such file or directory\n[exit 1]",
                           "Reproduce with an empty table")]),
        ("Reproduced: no file at all is written for an empty table, so no header either.",
         None, [todo([("Reproduce the missing header", "completed"),
                      ("Fix the writer", "in_progress"),
                      ("Add a regression test", "pending")])]),
        (None, None, [read("tests/test_writer.py", tests)]),
        ("The fix is to drop the early return so that the header is always written.", None,
         [edit("src/csvkit_lite/writer.py", "    if not rows:\n        return 0\n", "")]),
        (None, None, [read("src/csvkit_lite/writer.py", fixed)]),
        (None, None, [bash("python -c \"from csvkit_lite.table import Table; "
                           "Table(['a','b']).export('/tmp/e.csv')\"; cat /tmp/e.csv",
                           "a,b\n", "Check the header is written now")]),
        (None, None, [bash("python -m pytest -q tests", "..\n2 passed in 0.04s\n",
                           "Run the tests")]),
        ("The existing test passes. Now the regression test for the empty table.", None,
         [todo([("Reproduce the missing header", "completed"), ("Fix the writer", "completed"),
                ("Add a regression test", "in_progress")])]),
        (None, None, [edit("tests/test_writer.py",
                           "    assert path.read_text().splitlines() == ['a', '1', '2']\n",
                           "    assert path.read_text().splitlines() == ['a', '1', '2']\n\n\n"
                           "def test_an_empty_table_keeps_its_header(tmp_path):\n    path = "
                           "tmp_path / 'out.csv'\n    assert write_rows(path, ['a', 'b'], []) "
                           "== 0\n    assert path.read_text() == 'a,b\\r\\n'\n")]),
        (None, None, [bash("python -m pytest -q tests", "...\n3 passed in 0.05s\n",
                           "Run the tests again")]),
        ("All three pass. The subagent found a second writer in table.py? No: it reported "
         "only writer.py writes CSV; table.py delegates. Let me double-check the docs "
         "mention the behaviour.", None,
         [grep("header", "README.md:14:Exported files always start with a header row.")]),
        (None, None, [bash("git diff --stat", " src/csvkit_lite/writer.py | 2 --\n "
                           "tests/test_writer.py      | 7 +++++++\n 2 files changed, 7 "
                           "insertions(+), 2 deletions(-)\n", "Show the change")]),
        (None, "Fixed: `write_rows` returned before writing the header when there were no "
               "rows, so an empty table produced no file at all. It now always writes the "
               "header, and `tests/test_writer.py` has a regression test. All tests pass.",
         []),
        # the user's second request (the prompt is inserted before this call)
        ("The user wants a --no-header option for the CLI. Let me find the CLI entry point.",
         None, [grep("argparse", "src/csvkit_lite/__init__.py:3:import argparse")]),
        (None, None, [read("src/csvkit_lite/__init__.py",
                           "import sys\n\nimport argparse\n\nfrom .table import Table\n\n\n"
                           "def main(argv=None):\n    parser = argparse.ArgumentParser()\n"
                           "    parser.add_argument('out')\n    args = parser.parse_args("
                           "argv)\n    Table(['a']).export(args.out)\n")]),
        ("I will thread a header flag from the parser through Table.export into write_rows.",
         None, [edit("src/csvkit_lite/writer.py", "def write_rows(path, header, rows):",
                     "def write_rows(path, header, rows, *, with_header=True):")]),
        (None, None, [edit("src/csvkit_lite/writer.py", "        out.writerow(header)\n",
                           "        if with_header:\n            out.writerow(header)\n")]),
        (None, None, [edit("src/csvkit_lite/table.py", "    def export(self, path):\n        "
                           "return write_rows(path, self.header, self.rows)\n",
                           "    def export(self, path, *, with_header=True):\n        return "
                           "write_rows(path, self.header, self.rows, with_header=with_header)"
                           "\n")]),
        (None, None, [edit("src/csvkit_lite/__init__.py", "    parser.add_argument('out')\n",
                           "    parser.add_argument('out')\n    parser.add_argument("
                           "'--no-header', action='store_true')\n")]),
        (None, None, [edit("src/csvkit_lite/__init__.py",
                           "    Table(['a']).export(args.out)\n",
                           "    Table(['a']).export(args.out, with_header=not args.no_header)"
                           "\n")]),
        ("Now a test for the flag, through main().", None,
         [edit("tests/test_writer.py", "from csvkit_lite.writer import write_rows\n",
               "from csvkit_lite import main\nfrom csvkit_lite.writer import write_rows\n")]),
        (None, None, [bash("cat >> tests/test_writer.py <<'EOF'\n\n\ndef test_no_header_flag("
                           "tmp_path):\n    main([str(tmp_path / 'o.csv'), '--no-header'])\n"
                           "    assert (tmp_path / 'o.csv').read_text() == ''\nEOF",
                           "", "Append a test of --no-header")]),
        (None, None, [bash("python -m pytest -q tests", "F...\n1 failed, 3 passed in 0.07s\n"
                           "FAILED tests/test_writer.py::test_no_header_flag - "
                           "AssertionError: assert 'a\\r\\n' == ''\n", "Run the tests")]),
        ("The flag is parsed but main() passes it wrong? No: argparse turns --no-header into "
         "no_header, which I used. Let me look at the file as it is now.", None,
         [read("src/csvkit_lite/table.py", table.replace(
             "    def export(self, path):\n        return write_rows(path, self.header, "
             "self.rows)\n", "    def export(self, path, *, with_header=True):\n        "
             "return write_rows(path, self.header, self.rows, with_header=with_header)\n"))]),
        (None, None, [bash("pip install -e . -q && python -m pytest -q tests",
                           "....\n4 passed in 0.06s\n",
                           "Reinstall the package and run the tests")]),
        ("The installed copy was stale; after reinstalling all four pass.", None,
         [bash("git diff --stat", " src/csvkit_lite/__init__.py |  5 +++--\n src/csvkit_lite/"
               "table.py    |  4 ++--\n src/csvkit_lite/writer.py   |  7 ++++---\n tests/"
               "test_writer.py        | 14 ++++++++++++++\n 4 files changed, 23 insertions(+), "
               "7 deletions(-)\n", "Show the change")]),
        (None, "Added `--no-header`: `main()` passes `with_header=not args.no_header` to "
               "`Table.export`, which passes it to `write_rows`. The new test failed at first "
               "only because the installed package was stale; after `pip install -e .` all "
               "four tests pass.", []),
    ]


SUB_SCRIPT = [
    ("Search for csv module use across src.", None,
     [("Grep", {"pattern": "csv\\.", "path": f"{CWD}/src", "output_mode": "content"},
       "src/csvkit_lite/writer.py:9:        out = csv.writer(fh)", {"mode": "content"})]),
    (None, None, [("Read", {"file_path": f"{CWD}/src/csvkit_lite/writer.py"},
                   _numbered(FILES["src/csvkit_lite/writer.py"]), {"type": "text"})]),
    ("table.py only delegates; confirm it has no writer of its own.", None,
     [("Read", {"file_path": f"{CWD}/src/csvkit_lite/table.py"},
       _numbered(FILES["src/csvkit_lite/table.py"]), {"type": "text"})]),
    (None, "Only `src/csvkit_lite/writer.py` writes CSV (`write_rows`, line 9). "
           "`Table.export` delegates to it. With an empty table `write_rows` returns 0 "
           "before opening the file, so neither the file nor its header is written.", []),
]


class _Transcript:
    """Lines of one transcript, with the usage bookkeeping of a prompt cache."""

    def __init__(self, *, sidechain: bool, system_tokens: int, clock: float) -> None:
        self.lines: list[dict[str, Any]] = []
        self.sidechain = sidechain
        self.parent: str | None = None
        self.messages: list[Any] = []  # what the conversation holds, for token estimates
        self.system_tokens = system_tokens
        self.cached = 0  # tokens the next call reads from the cache
        self.clock = clock
        self.calls = 0

    def envelope(self, kind: str) -> dict[str, Any]:
        self.clock += 1.7
        line = {"parentUuid": self.parent, "isSidechain": self.sidechain,
                "userType": "external", "cwd": CWD, "sessionId": SESSION, "version": VERSION,
                "gitBranch": "main"}
        if self.sidechain:
            line["agentId"] = AGENT
        line.update({"slug": "tidy-exporting-heron", "type": kind})
        return line

    def add(self, line: dict[str, Any]) -> dict[str, Any]:
        line.setdefault("uuid", _uuid(self.sidechain, len(self.lines)))
        line.setdefault("timestamp", _time(self.clock))
        self.lines.append(line)
        if line["type"] in ("user", "assistant"):
            self.parent = line["uuid"]
        return line

    def user(self, content: Any, **extra: Any) -> dict[str, Any]:
        line = self.envelope("user")
        line["message"] = {"role": "user", "content": content}
        line.update(extra)
        self.messages.append(content)
        return self.add(line)

    def response(self, thinking: str | None, text: str | None,
                 uses: list[tuple[str, dict, Any, dict]]) -> list[dict[str, Any]]:
        """One API response, written as one line a content block (Claude Code's way)."""
        self.calls += 1
        tag = "sub" if self.sidechain else "main"
        blocks: list[dict[str, Any]] = []
        if thinking:
            blocks.append({"type": "thinking", "thinking": thinking,
                           "signature": "Eq" + _hex(tag, self.calls, "sig", size=64) + "=="})
        if text:
            blocks.append({"type": "text", "text": text})
        for position, (name, tool_input, _, _) in enumerate(uses):
            blocks.append({"type": "tool_use",
                           "id": f"toolu_01{_hex(tag, self.calls, position, size=22)}",
                           "name": name, "input": tool_input})
        prompt = self.system_tokens + sum(_tokens(m) for m in self.messages)
        read = self.cached
        fresh = 3 if self.calls > 1 else 4
        write = max(0, prompt - read - fresh)
        output = sum(_tokens(b) for b in blocks) + 12
        message_id = f"msg_01{_hex(tag, self.calls, 'msg', size=22)}"
        request_id = f"req_011C{_hex(tag, self.calls, 'req', size=20)}"
        written = []
        for index, block in enumerate(blocks):
            is_last = index == len(blocks) - 1
            usage = {"input_tokens": fresh, "cache_creation_input_tokens": write,
                     "cache_read_input_tokens": read,
                     "cache_creation": {"ephemeral_5m_input_tokens": 0,
                                        "ephemeral_1h_input_tokens": write},
                     "output_tokens": output if is_last else min(output, 8 * (index + 1)),
                     "service_tier": "standard"}
            line = self.envelope("assistant")
            line["message"] = {
                "model": "claude-sonnet-4-5-20250929" if not self.sidechain
                else "claude-haiku-4-5-20251001",
                "id": message_id, "type": "message", "role": "assistant", "content": [block],
                "stop_reason": ("tool_use" if uses else "end_turn") if is_last else None,
                "stop_sequence": None, "usage": usage}
            line["requestId"] = request_id
            written.append(self.add(line))
        self.messages.append(blocks)
        self.cached = prompt + output  # the next call reads all of this from the cache
        return written

    def results(self, written: list[dict[str, Any]],
                uses: list[tuple[str, dict, Any, dict]], sub_result: Any = None) -> None:
        tool_lines = [w for w in written if w["message"]["content"][0]["type"] == "tool_use"]
        for line, (name, _, result, structured) in zip(tool_lines, uses, strict=True):
            block = line["message"]["content"][0]
            if name not in ("Task", "TodoWrite"):
                self.add({"parentUuid": line["uuid"], "isSidechain": self.sidechain,
                          "userType": "external", "cwd": CWD, "sessionId": SESSION,
                          "version": VERSION, "gitBranch": "main",
                          **({"agentId": AGENT} if self.sidechain else {}),
                          "slug": "tidy-exporting-heron", "type": "progress",
                          "data": {"type": "hook_progress", "hookEvent": "PostToolUse",
                                   "hookName": f"PostToolUse:{name}",
                                   "command": "$CLAUDE_PROJECT_DIR/.claude/hooks/log.sh"},
                          "parentToolUseID": block["id"], "toolUseID": block["id"],
                          "uuid": _uuid(self.sidechain, "progress", len(self.lines)),
                          "timestamp": _time(self.clock + 0.4)})
            content: Any = result
            if result == "@SUBAGENT":
                content, structured = sub_result
            self.user([{"tool_use_id": block["id"], "type": "tool_result", "content": content}],
                      toolUseResult=structured, sourceToolAssistantUUID=line["uuid"])


def write_claude_code() -> None:
    sub = _Transcript(sidechain=True, system_tokens=SUB_SYSTEM_TOKENS, clock=200.0)
    task = next(u for _, _, uses in _main_script() for u in uses if u[0] == "Task")
    sub.user(task[1]["prompt"])
    for thinking, text, uses in SUB_SCRIPT:
        written = sub.response(thinking, text, uses)
        if uses:
            sub.results(written, uses)
    final = SUB_SCRIPT[-1][1]
    sub_result = (
        [{"type": "text", "text": final},
         {"type": "text", "text": f"agentId: {AGENT} (for resuming to continue this agent's "
                                  "work if needed)"}],
        {"status": "completed", "prompt": task[1]["prompt"], "agentId": AGENT,
         "content": [{"type": "text", "text": final}], "totalDurationMs": 18_422,
         "totalTokens": 7_310, "totalToolUseCount": 3,
         "usage": {"input_tokens": 6, "cache_creation_input_tokens": 812,
                   "cache_read_input_tokens": 6_201, "output_tokens": 291}})

    main = _Transcript(sidechain=False, system_tokens=SYSTEM_TOKENS, clock=0.0)
    main.lines.append({"type": "summary", "summary": "Empty CSV export loses its header row",
                       "leafUuid": _uuid(False, "leaf")})
    first_prompt = ("Exporting an empty table with csvkit-lite gives a CSV file without the "
                    "header row (actually, no file at all). Can you fix it?")
    main.lines.append({"type": "file-history-snapshot", "messageId": _uuid(False, "snap", 0),
                       "snapshot": {"messageId": _uuid(False, "snap", 0),
                                    "trackedFileBackups": {}, "timestamp": _time(0.2)},
                       "isSnapshotUpdate": False})
    main.user(first_prompt, thinkingMetadata={"level": "high", "disabled": False,
                                              "triggers": []}, todos=[],
              permissionMode="default")
    script = _main_script()
    second = ("Thanks. Could you also add a --no-header option to the command line, so that "
              "people who append to existing files can leave the header out?")
    for number, (thinking, text, uses) in enumerate(script):
        if number == 17:
            main.lines.append({"type": "file-history-snapshot",
                               "messageId": _uuid(False, "snap", 1),
                               "snapshot": {"messageId": _uuid(False, "snap", 1),
                                            "trackedFileBackups": {
                                                "src/csvkit_lite/writer.py": {
                                                    "backupFileName": "a1b2c3@v1", "version": 1,
                                                    "backupTime": _time(main.clock)}},
                                            "timestamp": _time(main.clock)},
                               "isSnapshotUpdate": False})
            main.user(second, permissionMode="default")
        written = main.response(thinking, text, uses)
        if uses:
            main.results(written, uses, sub_result)
    main.lines.append({"parentUuid": main.parent, "isSidechain": False, "userType": "external",
                       "cwd": CWD, "sessionId": SESSION, "version": VERSION,
                       "gitBranch": "main", "slug": "tidy-exporting-heron", "type": "system",
                       "subtype": "turn_duration", "durationMs": 148_211, "isMeta": False,
                       "uuid": _uuid(False, "system"), "timestamp": _time(main.clock + 1)})
    folder = DATA / "claude_code"
    (folder / SESSION / "subagents").mkdir(parents=True, exist_ok=True)
    _write(folder / f"{SESSION}.jsonl", main.lines)
    _write(folder / SESSION / "subagents" / f"agent-{AGENT}.jsonl", sub.lines)


# -- Codex ---------------------------------------------------------------------------------

ROLLOUT = "019a9f3e-5b21-7c40-8e1d-3f6a2b9c4d71"
INSTRUCTIONS = ("You are Codex, a coding agent based on GPT-5. You and the user share the "
                "same workspace and collaborate to achieve the user's goals.\n\n# General\n\n"
                "- When searching for text or files, prefer using `rg`.\n- Default to ASCII "
                "when editing or creating files.\n")


def write_codex() -> None:
    lines: list[dict[str, Any]] = []
    clock = [0.0]
    usage_total = {"input_tokens": 0, "cached_input_tokens": 0, "output_tokens": 0,
                   "reasoning_output_tokens": 0, "total_tokens": 0}
    history_tokens = [len(INSTRUCTIONS) // 4 + 2_140]  # instructions and tools
    cached = [0]
    calls = [0]

    def at() -> str:
        clock[0] += 1.3
        return f"2026-11-20T10:{int(clock[0] // 60):02d}:{clock[0] % 60:06.3f}Z"

    def line(kind: str, payload: dict[str, Any]) -> None:
        lines.append({"timestamp": at(), "type": kind, "payload": payload})

    def item(payload: dict[str, Any]) -> None:
        history_tokens[0] += _tokens(payload)
        line("response_item", payload)

    def message(role: str, text: str) -> None:
        kind = "output_text" if role == "assistant" else "input_text"
        payload: dict[str, Any] = {"type": "message", "role": role,
                                   "content": [{"type": kind, "text": text}]}
        if role == "assistant":
            payload["phase"] = "final_answer"
        item(payload)

    def token_count(output: int, reasoning: int) -> None:
        calls[0] += 1
        prompt = history_tokens[0]
        read = min(prompt, cached[0] // 128 * 128)
        last = {"input_tokens": prompt, "cached_input_tokens": read, "output_tokens": output,
                "reasoning_output_tokens": reasoning, "total_tokens": prompt + output}
        for key, value in last.items():
            usage_total[key] += value
        line("event_msg", {"type": "token_count", "info": {
            "total_token_usage": dict(usage_total), "last_token_usage": last,
            "model_context_window": 258_400},
            "rate_limits": {"primary": {"used_percent": 4.0 + calls[0] / 10,
                                        "window_minutes": 300, "resets_at": 1_763_650_000},
                            "secondary": None}})
        cached[0] = prompt + output

    def reasoning(summary: str) -> None:
        item({"type": "reasoning", "summary": [{"type": "summary_text", "text": summary}],
              "content": None,
              "encrypted_content": "gAAAAABp" + _hex("enc", calls[0], summary, size=64) * 3})

    def shell(call: str, command: str, output: str) -> tuple[str, str]:
        item({"type": "function_call", "name": "shell_command",
              "arguments": json.dumps({"command": command, "workdir": "/home/dev/svc",
                                       "timeout_ms": 120000}, separators=(",", ":")),
              "call_id": call})
        return call, output

    def outputs(*pairs: tuple[str, str]) -> None:
        for call, output in pairs:
            item({"type": "function_call_output", "call_id": call, "output":
                  f"Exit code: 0\nWall time: 0.{len(output) % 9 + 1} seconds\nOutput:\n{output}"})

    line("session_meta", {"id": ROLLOUT, "timestamp": "2026-11-20T10:00:00.000Z",
                          "cwd": "/home/dev/svc", "originator": "codex_cli_rs",
                          "cli_version": "0.63.0", "instructions": None, "source": "cli",
                          "model_provider": "openai",
                          "base_instructions": {"text": INSTRUCTIONS},
                          "git": {"commit_hash": _hex("commit", size=40), "branch": "main",
                                  "repository_url": "git@example.com:dev/svc.git"}})
    line("event_msg", {"type": "task_started", "model_context_window": 258_400})
    message("developer", "<permissions instructions>\nFilesystem sandboxing: workspace-write."
                         "\nApprovals: on-request.\n</permissions instructions>")
    message("user", "<environment_context>\n  <cwd>/home/dev/svc</cwd>\n  <shell>bash</shell>"
                    "\n</environment_context>")
    line("turn_context", {"cwd": "/home/dev/svc", "approval_policy": "on-request",
                          "sandbox_policy": {"type": "workspace-write", "network_access": False},
                          "model": "gpt-5.1-codex", "effort": "medium", "summary": "auto"})
    ask = ("GET /health answers 500 when the database is down. It should answer 503 with a "
           "JSON body {\"status\": \"db_unavailable\"}.")
    message("user", ask)
    line("event_msg", {"type": "user_message", "message": ask, "images": []})
    line("event_msg", {"type": "token_count", "info": None, "rate_limits": {
        "primary": {"used_percent": 4.0, "window_minutes": 300, "resets_at": 1_763_650_000},
        "secondary": None}})

    reasoning("**Finding the health handler**")
    outputs(shell("call_h01", "rg -n \"health\" app", "app/routes.py:12:@app.get('/health')\n"
                                                       "app/routes.py:13:def health():"))
    token_count(38, 22)
    reasoning("**Reading routes and db**")
    first, second = (shell("call_h02", "sed -n '1,40p' app/routes.py",
                           "from .db import ping\n\n@app.get('/health')\ndef health():\n    "
                           "ping()\n    return {'status': 'ok'}\n"),
                     shell("call_h03", "sed -n '1,30p' app/db.py",
                           "class DatabaseDown(Exception):\n    pass\n\n\ndef ping():\n    "
                           "if not _pool.ok():\n        raise DatabaseDown()\n"))
    outputs(first, second)
    token_count(71, 40)
    reasoning("**Patching the handler**")
    item({"type": "custom_tool_call", "status": "completed", "call_id": "call_h04",
          "name": "apply_patch",
          "input": "*** Begin Patch\n*** Update File: app/routes.py\n@@\n-from .db import ping"
                   "\n+from .db import DatabaseDown, ping\n@@ def health():\n-    ping()\n+    "
                   "try:\n+        ping()\n+    except DatabaseDown:\n+        return {'status'"
                   ": 'db_unavailable'}, 503\n     return {'status': 'ok'}\n*** End Patch\n"})
    line("event_msg", {"type": "patch_apply_end", "call_id": "call_h04", "stdout":
                       "Success. Updated the following files:\nM app/routes.py\n", "stderr": "",
                       "success": True})
    item({"type": "custom_tool_call_output", "call_id": "call_h04", "output": json.dumps(
        {"output": "Success. Updated the following files:\nM app/routes.py\n",
         "metadata": {"exit_code": 0, "duration_seconds": 0.0}}, separators=(",", ":"))})
    token_count(164, 58)
    reasoning("**Running the tests**")
    outputs(shell("call_h05", "pytest -q tests/test_health.py",
                  "F\nFAILED tests/test_health.py::test_db_down - assert 500 == 503\n"))
    token_count(44, 31)
    reasoning("**Checking the test client**")
    outputs(shell("call_h06", "sed -n '1,30p' tests/test_health.py",
                  "def test_db_down(client, monkeypatch):\n    monkeypatch.setattr('app.routes."
                  "ping', _raise)\n    assert client.get('/health').status_code == 503\n"))
    token_count(52, 47)
    reasoning("**Tuple returns need make_response**")
    item({"type": "custom_tool_call", "status": "completed", "call_id": "call_h07",
          "name": "apply_patch",
          "input": "*** Begin Patch\n*** Update File: app/routes.py\n@@ def health():\n-        "
                   "return {'status': 'db_unavailable'}, 503\n+        return jsonify(status="
                   "'db_unavailable'), 503\n*** End Patch\n"})
    item({"type": "custom_tool_call_output", "call_id": "call_h07", "output": json.dumps(
        {"output": "Success. Updated the following files:\nM app/routes.py\n",
         "metadata": {"exit_code": 0, "duration_seconds": 0.0}}, separators=(",", ":"))})
    token_count(96, 39)
    reasoning("**Re-running the tests**")
    outputs(shell("call_h08", "pytest -q", "....\n4 passed in 0.31s\n"))
    token_count(30, 12)
    done = ("`GET /health` now catches `DatabaseDown` and answers 503 with "
            "`{\"status\": \"db_unavailable\"}`; the existing test passes (4 passed).")
    message("assistant", done)
    line("event_msg", {"type": "agent_message", "message": done})
    token_count(61, 0)
    line("event_msg", {"type": "task_complete", "last_agent_message": done})

    line("event_msg", {"type": "task_started", "model_context_window": 258_400})
    line("turn_context", {"cwd": "/home/dev/svc", "approval_policy": "on-request",
                          "sandbox_policy": {"type": "workspace-write", "network_access": False},
                          "model": "gpt-5.1-codex", "effort": "medium", "summary": "auto"})
    again = "Please also log the outage once per minute at most, not on every request."
    message("user", again)
    line("event_msg", {"type": "user_message", "message": again, "images": []})
    reasoning("**Looking for a rate limiter**")
    outputs(shell("call_h09", "rg -n \"limit|throttle\" app", ""))
    token_count(40, 55)
    reasoning("**Adding a module-level timestamp**")
    item({"type": "custom_tool_call", "status": "completed", "call_id": "call_h10",
          "name": "apply_patch",
          "input": "*** Begin Patch\n*** Update File: app/routes.py\n@@\n+_last_outage_log = "
                   "0.0\n@@ def health():\n     except DatabaseDown:\n+        global "
                   "_last_outage_log\n+        if time.monotonic() - _last_outage_log > 60:\n"
                   "+            log.warning('database down')\n+            _last_outage_log = "
                   "time.monotonic()\n*** End Patch\n"})
    item({"type": "custom_tool_call_output", "call_id": "call_h10", "output": json.dumps(
        {"output": "Success. Updated the following files:\nM app/routes.py\n",
         "metadata": {"exit_code": 0, "duration_seconds": 0.0}}, separators=(",", ":"))})
    token_count(140, 61)
    reasoning("**Running the tests again**")
    outputs(shell("call_h11", "pytest -q", "....\n4 passed in 0.29s\n"))
    token_count(28, 10)
    final = ("The outage is now logged at most once a minute (`_last_outage_log` with "
             "`time.monotonic()`); all 4 tests pass.")
    message("assistant", final)
    line("event_msg", {"type": "agent_message", "message": final})
    token_count(37, 0)
    line("event_msg", {"type": "task_complete", "last_agent_message": final})
    folder = DATA / "codex"
    folder.mkdir(exist_ok=True)
    _write(folder / f"rollout-2026-11-20T10-00-00-{ROLLOUT}.jsonl", lines)


# -- mini-swe-agent with DeepSeek's raw responses -------------------------------------------


def write_mini_deepseek() -> None:
    document = json.loads((DATA / "openai_mini_swe_agent_v2.json").read_text())
    document["info"]["config"]["model"]["model_name"] = "deepseek/deepseek-chat"
    prompt = 0
    cached = 0
    for index, message in enumerate(document["messages"]):
        prompt += _tokens(message.get("content")) + 4
        if message["role"] != "assistant":
            continue
        completion = _tokens(message.get("tool_calls") or message.get("content")) + 3
        hit = cached // 64 * 64  # DeepSeek's disk cache works in 64-token units
        choice = {k: v for k, v in message.items() if k != "extra"}
        message["extra"]["response"] = {
            "id": f"{_hex('deepseek', index, size=8)}-{_hex('ds', index, size=4)}-4"
                  f"{_hex('x', index, size=3)}-9{_hex('y', index, size=3)}-"
                  f"{_hex('z', index, size=12)}",
            "created": 1764500000 + index * 7, "model": "deepseek-chat",
            "object": "chat.completion", "system_fingerprint": "fp_ffc7281d48_prod0820_fp8_kvcache",
            "choices": [{"finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                         "index": 0, "message": copy.deepcopy(choice)}],
            "usage": {"completion_tokens": completion, "prompt_tokens": prompt,
                      "total_tokens": prompt + completion, "completion_tokens_details": None,
                      "prompt_tokens_details": {"audio_tokens": None, "cached_tokens": hit},
                      "prompt_cache_hit_tokens": hit, "prompt_cache_miss_tokens": prompt - hit},
        }
        prompt += completion
        cached = prompt
    (DATA / "openai_mini_swe_agent_v2_deepseek.json").write_text(
        json.dumps(document, indent=2, ensure_ascii=False) + "\n")


def _write(path: Path, lines: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"
                            for line in lines))


if __name__ == "__main__":
    write_claude_code()
    write_codex()
    write_mini_deepseek()
