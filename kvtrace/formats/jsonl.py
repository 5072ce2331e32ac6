"""JSON Lines: the agents' own logs (Claude Code transcripts, Codex rollouts) one event a line.

An agent appends one JSON object per line while it runs, so a log that was
copied while the agent wrote, or cut by a full disk, ends in half a line.
`parse_jsonl` reads every line first and refuses the whole file on the
first bad one, naming it (`session.jsonl line 12 is not JSON: ... (a
truncated line?)`): an importer then works on objects that each know
their line number, and nothing is recorded from a file that is not whole.
Blank lines are skipped (a trailing newline, an editor's empty line).

`dump_jsonl` writes lines back the way both agents do: compact JSON, one
object a line, UTF-8 (not escaped), a newline after each.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.store.objects import jsontext


@dataclass(frozen=True, slots=True)
class Line:
    """One event of a log: its 1-based line number and its object."""

    number: int
    value: dict[str, Any]


@dataclass(frozen=True, slots=True)
class JsonLines:
    """A whole log, every line an object; `source` names it in errors."""

    source: str
    lines: tuple[Line, ...]

    def __iter__(self) -> Iterator[Line]:
        return iter(self.lines)

    def __len__(self) -> int:
        return len(self.lines)

    def where(self, line: Line) -> str:
        """`source line N`, the prefix of every error about that line."""
        return f"{self.source} line {line.number}"

    @classmethod
    def of(cls, values: Iterable[Any], source: str) -> JsonLines:
        """Lines from parsed values (a program's list): line N is the N-th value."""
        lines = []
        for number, value in enumerate(values, start=1):
            if not isinstance(value, dict):
                raise UsageError(f"{source} line {number} is not a JSON object")
            lines.append(Line(number, value))
        return cls(source, tuple(lines))


def parse_jsonl(data: bytes | str, source: str) -> JsonLines:
    """Every line of `data` as an object, or a one-line UsageError naming the first bad line."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise UsageError(f"{source} is not UTF-8 text (byte {exc.start})") from exc
    lines = []
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        where = f"{source} line {number}"
        try:
            value = jsontext.loads(raw, where, parse_constant=_refuse_constant(where))
        except json.JSONDecodeError as exc:
            hint = "" if raw.rstrip().endswith("}") else " (a truncated line?)"
            raise UsageError(f"{where} is not JSON: {exc.msg} at column {exc.colno}{hint}"
                             ) from exc
        if not isinstance(value, dict):
            raise UsageError(f"{where} is not a JSON object (each line of a log is one event)")
        lines.append(Line(number, value))
    if not lines:
        raise UsageError(f"{source} has no line: there is nothing to import")
    return JsonLines(source, tuple(lines))


def dump_jsonl(values: Sequence[Any]) -> bytes:
    """The lines as JSON Lines bytes: compact, UTF-8, one object and a newline each."""
    return b"".join(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
                    + b"\n" for value in values)


def _refuse_constant(where: str) -> Any:
    def refuse(name: str) -> Any:
        raise UsageError(f"{where}: {name} is not JSON (NaN and infinity cannot be stored)")

    return refuse
