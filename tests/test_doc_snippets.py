"""The README's and docs/*.md's ```python and ```bash snippets, run as they are written.

Read from the markdown at test time, so a changed doc is tested as it stands.
Each document runs in its own fresh working folder (`KVTRACE_HOME` there, so
`kvtrace.open_store()` and the `kvtrace` command use a real SQLite store in
it), its snippets in order and sharing one Python namespace: a tour's later
snippets see what the earlier ones did. The folder links the repository's
`tests/` and `examples/`, which snippets name by relative path.

- A python block is executed as it stands.
- A bash block is split into commands (`\\` continuations joined, comments
  dropped, `&&` separating); each `kvtrace ...` command is one test, run
  through the real CLI in-process (`kvtrace.cli.main`), which must exit 0.
  Any other program (make, curl, .venv/bin/python ...) must be marked skipped.
  In a command, `$PWD` is the document's folder, and `python` right after
  `--` (the program `kvtrace record` runs) is the interpreter running the
  tests, which has the agents' SDKs.
- The embedded model is replaced by a tiny random model with its tokenizer
  (`load_engine()` / `load_tokenizer()` with no name load it), so replay,
  continue, branch and report run in seconds; `$KVTRACE_CACHE` and `$HOME`
  point into the folder, so no KV block reaches the user's cache.

Markers, HTML comments right before a block (invisible on a rendered page):

    <!-- doc-test: skip (reason) -->              the whole block, reported with its reason
    <!-- doc-test: skip "kvtrace serve" (reason) -->   its commands starting so
    <!-- doc-test: setup (note)
    python code run first, in the document's namespace (tests/doc_worlds.py)
    -->

A snippet after a failed one in the same document is skipped, naming it; a
document's snippets build on each other, so select them together (`-k README`).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import doc_worlds

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<body>.*?)\s*(?P<end>-->)?\s*$")
_SKIP = re.compile(r'^skip\s*(?:"(?P<prefix>[^"]+)")?\s*\((?P<reason>.+)\)$')
_SETUP = re.compile(r"^setup\b")


@dataclass
class Block:
    """A fenced python or bash block and the markers before it."""

    doc: str
    line: int
    lang: str
    code: str
    skip: str | None = None
    skip_commands: dict[str, str] = field(default_factory=dict)
    setup: str = ""


@dataclass(frozen=True)
class Snippet:
    """One test: a python block, or one command of a bash block."""

    doc: str
    line: int
    lang: str
    code: str
    setup: str
    skip: str | None

    @property
    def label(self) -> str:
        first = self.code.strip().splitlines()[0] if self.code.strip() else ""
        return f"{self.doc}:{self.line}:{first[:60]}"


def parse_blocks(text: str, doc: str) -> list[Block]:
    """The python and bash blocks of a markdown text, with their markers."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending = Block(doc, 0, "", "")
    has_marker = False
    index = 0
    while index < len(lines):
        line = lines[index]
        marker = _MARKER.match(line)
        fence = _FENCE.match(line)
        if marker:
            body = marker.group("body")
            if marker.group("end") is None:  # a setup block: code until the closing -->
                end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "-->")
                code = "\n".join(lines[index + 1:end])
                index = end
            else:
                code = ""
            _apply_marker(pending, body, code, f"{doc}:{index + 1}")
            has_marker = True
        elif fence:
            end = next(i for i in range(index + 1, len(lines))
                       if lines[i].strip() == "```")
            lang = fence.group("lang")
            if lang in ("python", "bash"):
                pending.line, pending.lang = index + 1, lang
                pending.code = textwrap.dedent("\n".join(lines[index + 1:end]))
                blocks.append(pending)
            elif has_marker:
                raise ValueError(f"{doc}:{index + 1}: a doc-test marker before a {lang or 'plain'}"
                                 " block: markers go right before a python or bash block")
            pending, has_marker = Block(doc, 0, "", ""), False
            index = end
        index += 1
    return blocks


def _apply_marker(block: Block, body: str, code: str, where: str) -> None:
    skip = _SKIP.match(body)
    if skip and skip.group("prefix"):
        block.skip_commands[skip.group("prefix")] = skip.group("reason")
    elif skip:
        block.skip = skip.group("reason")
    elif _SETUP.match(body):
        block.setup += code + "\n"
    else:
        raise ValueError(f"{where}: unknown doc-test marker {body!r} "
                         "(skip (reason), skip \"prefix\" (reason), setup)")


def shell_commands(code: str) -> Iterator[tuple[int, str]]:
    """(line offset, command) for each command of a bash block."""
    lines = code.splitlines()
    start, joined = 0, ""
    for number, line in enumerate(lines):
        if not joined:
            start = number
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        joined += line
        words = shlex.split(joined, comments=True)
        joined = ""
        command: list[str] = []
        for word in [*words, "&&"]:
            if word == "&&":
                if command:
                    yield start, shlex.join(command)
                command = []
            else:
                command.append(word)


def block_snippets(block: Block) -> list[Snippet]:
    """The tests of one block: itself (python), or one per command (bash)."""
    if block.lang == "python":
        return [Snippet(block.doc, block.line, "python", block.code, block.setup, block.skip)]
    found: list[Snippet] = []
    setup, unused = block.setup, set(block.skip_commands)
    for offset, command in shell_commands(block.code):
        prefix = next((p for p in block.skip_commands if command.startswith(p)), None)
        unused.discard(prefix)
        skip = block.skip or (block.skip_commands[prefix] if prefix else None)
        found.append(Snippet(block.doc, block.line + 1 + offset, "bash", command, setup, skip))
        setup = ""
    if unused:  # the doc changed under its marker: say so rather than skip nothing
        raise ValueError(f"{block.doc}:{block.line}: no command of the block starts with "
                         f"{sorted(unused)}: update its doc-test marker")
    return found


def snippets() -> list[Snippet]:
    return [snippet for path in DOCS
            for block in parse_blocks(path.read_text(), path.relative_to(ROOT).as_posix())
            for snippet in block_snippets(block)]


class World:
    """One document's working folder and namespace, shared by its snippets in order."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.namespace: dict[str, Any] = {"__name__": "__doc_snippet__"}
        self.failed: str | None = None
        for name in ("tests", "examples"):
            (folder / name).symlink_to(ROOT / name)
        for name in ("home", "cache"):
            (folder / name).mkdir()

    def enter(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(self.folder)
        monkeypatch.setenv("KVTRACE_HOME", str(self.folder / ".kvtrace"))
        monkeypatch.setenv("KVTRACE_CACHE", str(self.folder / "cache"))
        monkeypatch.setenv("HOME", str(self.folder / "home"))
        monkeypatch.setenv("OPENAI_API_KEY", "sk-doc-test")  # what an SDK user has set
        monkeypatch.delenv("KVTRACE_STORE", raising=False)
        monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


@pytest.fixture(scope="session")
def doc_model(tiny_model_factory) -> Path:
    """The tiny random Llama that stands in for the embedded model (its tokenizer and template)."""
    return tiny_model_factory("doc-model", seed=11)


@pytest.fixture(scope="module")
def worlds() -> Iterator[dict[str, World]]:
    """Each document's World, made by its first snippet; the stores its snippets opened closed."""
    from kvtrace import Store

    made: dict[str, World] = {}
    yield made
    for world in made.values():
        for value in world.namespace.values():
            if isinstance(value, Store):
                value.close()


@pytest.fixture
def tiny_default_model(doc_model: Path, monkeypatch: pytest.MonkeyPatch,
                       one_torch_thread: None) -> Path:
    """`load_engine()` and `load_tokenizer()` without a name load the tiny model."""
    import kvtrace.engine

    load_engine, load_tokenizer = kvtrace.engine.load_engine, kvtrace.engine.load_tokenizer

    def tiny_engine(name_or_path: Any = None, **options: Any) -> Any:
        return load_engine(name_or_path or doc_model, **options)

    def tiny_tokenizer(name_or_path: Any = None, **options: Any) -> Any:
        return load_tokenizer(name_or_path or doc_model, **options)

    monkeypatch.setattr(kvtrace.engine, "load_engine", tiny_engine)
    monkeypatch.setattr(kvtrace.engine, "load_tokenizer", tiny_tokenizer)
    monkeypatch.setattr(doc_worlds, "TINY_MODEL", doc_model)
    return doc_model


SNIPPETS = snippets()


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.label for s in SNIPPETS])
def test_doc_snippet(snippet: Snippet, worlds: dict[str, World], tiny_default_model: Path,
                     tmp_path_factory, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    if snippet.doc not in worlds:
        folder = tmp_path_factory.mktemp(re.sub(r"\W", "-", snippet.doc))
        worlds[snippet.doc] = World(folder)
    world = worlds[snippet.doc]
    if world.failed:
        pytest.skip(f"an earlier snippet of {snippet.doc} failed: {world.failed}")
    world.enter(monkeypatch)
    try:
        if snippet.setup:
            exec(compile(snippet.setup, f"{snippet.doc} (setup before line {snippet.line})",
                         "exec"), world.namespace)
        if snippet.skip:
            pytest.skip(f"{snippet.doc}:{snippet.line}: {snippet.skip}")
        if snippet.lang == "python":
            exec(compile(snippet.code, f"{snippet.doc}:{snippet.line}", "exec"), world.namespace)
        else:
            code, output = _run_command(snippet, capsys)
            assert code == 0, f"{snippet.label} exited {code}\n{output}"
    except Exception:
        world.failed = snippet.label
        raise


def _run_command(snippet: Snippet, capsys) -> tuple[int, str]:
    from kvtrace.cli import main

    argv = shlex.split(snippet.code)
    if argv[0] != "kvtrace" or {"|", ">", ">>", "<", ";", "||", "&"} & set(argv):
        raise AssertionError(
            f"{snippet.doc}:{snippet.line}: `{snippet.code}` is not a plain kvtrace command "
            "(another program, a pipe or a redirection): mark it <!-- doc-test: skip \"...\" "
            "(reason) --> or make it one")
    argv = [arg.replace("$PWD", os.getcwd()) for arg in argv]
    if "--" in argv and argv[argv.index("--") + 1:][:1] == ["python"]:
        argv[argv.index("--") + 1] = sys.executable
    try:
        main(argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    else:
        code = 0
    out, err = capsys.readouterr()
    return code, f"stdout:\n{out[-2000:]}\nstderr:\n{err[-2000:]}"


def test_markers_parse():
    """Each marker is one of the three forms, right before a python or bash block."""
    text = ('<!-- doc-test: skip "kvtrace serve" (a server) -->\n'
            "<!-- doc-test: setup (a run)\nx = 1\n-->\n"
            "```bash\nkvtrace runs \\\n  --json   # all\nkvtrace serve && kvtrace runs\n```\n")
    [block] = parse_blocks(text, "sample.md")
    assert block.skip_commands == {"kvtrace serve": "a server"}
    assert block.setup.strip() == "x = 1"
    assert list(shell_commands(block.code)) == [
        (0, "kvtrace runs --json"), (2, "kvtrace serve"), (2, "kvtrace runs")]


def test_a_skip_marker_naming_no_command_is_an_error():
    [block] = parse_blocks('<!-- doc-test: skip "kvtrace serve" (a server) -->\n'
                           "```bash\nkvtrace runs\n```\n", "sample.md")
    with pytest.raises(ValueError, match="update its doc-test marker"):
        block_snippets(block)
