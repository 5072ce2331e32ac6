"""Trajectories in and out: other tools' formats converted to and from a run's steps.

One module per format, each converting a whole document to the store's
records and back (`import_X(store, document, *, run)`, `export_X(store,
spec)`): `openai.py` (a list of chat messages), `atif.py` / `atif_export.py`
(Harbor's Agent Trajectory Interchange Format), `otel.py` / `otel_import.py`
(OpenTelemetry OTLP-JSON spans with the GenAI conventions), and the
agents' own logs, JSON Lines (jsonl.py): `claude_code.py` /
`claude_code_export.py` (Claude Code session transcripts, subagents as
runs of their own) and `codex.py` / `codex_export.py` (Codex rollouts). Bundles,
kvtrace's own lossless format, stay in the store (`Store.export_run`,
`Store.import_bundle`). This module picks one by name for the CLI and for
programs; docs/formats.md has the mappings.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from enum import StrEnum
from typing import IO, Any

from kvtrace.errors import UsageError
from kvtrace.formats.atif import atif_records, import_atif
from kvtrace.formats.atif_export import export_atif
from kvtrace.formats.claude_code import (
    claude_code_plan,
    claude_code_records,
    import_claude_code,
    read_session,
)
from kvtrace.formats.claude_code_export import export_claude_code
from kvtrace.formats.codex import codex_records, import_codex
from kvtrace.formats.codex_export import export_codex
from kvtrace.formats.jsonl import dump_jsonl, parse_jsonl
from kvtrace.formats.openai import export_openai, import_openai, openai_records
from kvtrace.formats.otel import export_otel
from kvtrace.formats.otel_import import import_otel, otel_records
from kvtrace.formats.records import parse_json
from kvtrace.store import OnStep, RunInfo, Store, validate_run_name

__all__ = [
    "Format",
    "atif_records",
    "claude_code_plan",
    "claude_code_records",
    "codex_records",
    "default_run_name",
    "export_atif",
    "export_claude_code",
    "export_codex",
    "export_document",
    "export_file",
    "export_openai",
    "export_otel",
    "import_atif",
    "import_claude_code",
    "import_codex",
    "import_document",
    "import_file",
    "import_openai",
    "import_otel",
    "openai_records",
    "otel_records",
    "subagent_runs",
]


class Format(StrEnum):
    """The formats `kvtrace import` and `kvtrace export` read and write."""

    BUNDLE = "bundle"
    OPENAI = "openai"
    ATIF = "atif"
    OTEL = "otel"
    CLAUDE_CODE = "claude-code"
    CODEX = "codex"


JSON_LINES = frozenset({Format.CLAUDE_CODE, Format.CODEX})  # one JSON object a line
_IMPORTERS: dict[Format, Callable[..., RunInfo]] = {
    Format.OPENAI: import_openai,
    Format.ATIF: import_atif,
    Format.OTEL: import_otel,
    Format.CLAUDE_CODE: import_claude_code,
    Format.CODEX: import_codex,
}
_EXPORTERS: dict[Format, Callable[..., Any]] = {
    Format.OPENAI: export_openai,
    Format.ATIF: export_atif,
    Format.CLAUDE_CODE: export_claude_code,
    Format.CODEX: export_codex,
}


def import_document(store: Store, document: Any, *, format: str, run: str,
                    on_step: OnStep | None = None) -> RunInfo:
    """Record a parsed document of `format` as the new run `run`.

    A JSON value for openai, atif and otel; for claude-code and codex the
    log's lines (`parse_jsonl`, or a list of line objects; a Claude Code
    session with its subagents' files from `read_session`). `on_step(done,
    total)` is told as each step of the run is written (a progress bar).
    """
    return _IMPORTERS[_document_format(format)](store, document, run=run, on_step=on_step)


def export_document(
    store: Store, spec: str, *, format: str, include_content: bool = False,
    on_step: OnStep | None = None,
) -> Any:
    """The run up to `spec` as a document of `format` (claude-code, codex: a list of lines).

    `include_content` puts prompts, responses, tool arguments and results
    into OTel spans (they are left out by default); the other formats always
    carry them. `on_step(done, total)` is told as each step is read.
    """
    kind = _document_format(format)
    if kind is Format.OTEL:
        return export_otel(store, spec, include_content=include_content, on_step=on_step)
    return _EXPORTERS[kind](store, spec, on_step=on_step)


def import_file(
    store: Store, file: IO[bytes], *, format: str = Format.BUNDLE, run: str | None = None,
    filename: str | None = None, on_step: OnStep | None = None,
) -> RunInfo:
    """Import a file of any format; nothing is written unless the whole file is good.

    `run` defaults to the bundle's own run, or for the other formats to the
    file's name without its extensions (`default_run_name`). A Claude Code
    session's subagents are read from their files beside `filename`
    (`read_session`). `on_step` as for `import_document` (not for bundles).
    """
    kind = Format(_known(format))
    source = filename or "the file"
    if not file.seekable():
        file = io.BytesIO(file.read())
    start = file.tell()
    guess = guess_format(file.read(_GUESS_BYTES + 1))
    file.seek(start)
    if guess is not None and guess is not kind:
        flag = "--format" if filename is not None else "format="
        raise UsageError(f"{source} looks like {_FORMAT_NAMES[guess]}, not {_FORMAT_NAMES[kind]}:"
                         f" import it with {flag}{'' if flag.endswith('=') else ' '}{guess}",
                         param="format")
    if kind is Format.BUNDLE:
        return store.import_bundle(file, name=run)
    if run is None:
        if filename is None:
            raise UsageError("name the run to import into")
        run = default_run_name(filename)
    data = file.read()
    if kind is Format.CLAUDE_CODE:
        document: Any = read_session(data, filename)
    elif kind is Format.CODEX:
        document = parse_jsonl(data, source)
    else:
        document = parse_json(data, source)
    return import_document(store, document, format=kind, run=run, on_step=on_step)


def export_file(
    store: Store, spec: str, file: IO[bytes], *, format: str = Format.BUNDLE,
    include_content: bool = False, on_step: OnStep | None = None,
) -> None:
    """Write the run `spec` in any format (a bundle takes a run name; the others any step).

    `on_step` as for `export_document` (not for bundles)."""
    kind = Format(_known(format))
    if include_content and kind is not Format.OTEL:
        raise UsageError("include_content applies to the otel format only (the others always "
                         "carry the content)")
    if kind is Format.BUNDLE:
        store.export_run(spec, file)
        return
    document = export_document(store, spec, format=kind, include_content=include_content,
                               on_step=on_step)
    if kind in JSON_LINES:
        file.write(dump_jsonl(document))
        return
    file.write(json.dumps(document, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")


def subagent_runs(store: Store, run: str) -> list[RunInfo]:
    """The runs a Claude Code import made of run `run`'s subagents (`RUN/agent-<id>`)."""
    return store.runs(prefix=f"{run}/agent-")


def default_run_name(filename: str) -> str:
    """The run a file imports into by default: its name up to the first dot."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1].split(".", 1)[0]
    try:
        return validate_run_name(name)
    except UsageError as exc:
        raise UsageError(f"{exc}; name the run yourself (run=NAME)", param="run") from exc


_FORMAT_NAMES = {
    Format.BUNDLE: "a kvtrace bundle", Format.OPENAI: "an OpenAI messages trajectory",
    Format.ATIF: "an ATIF trajectory", Format.OTEL: "an OTLP-JSON trace",
    Format.CLAUDE_CODE: "a Claude Code session log", Format.CODEX: "a Codex rollout",
}
_GUESS_BYTES = 1 << 20  # what `guess_format` reads of a file
_CODEX_LINES = frozenset({"session_meta", "response_item", "turn_context", "event_msg",
                          "compacted"})
_CLAUDE_CODE_LINES = frozenset({"user", "assistant", "summary", "system",
                                "file-history-snapshot"})


def guess_format(data: bytes) -> Format | None:
    """The format a file beginning with `data` plainly is, from its first line or (a whole
    file of at most `_GUESS_BYTES`) its top-level keys; None when it is none of them plainly
    (the importer then says what is wrong)."""
    text = data.lstrip().decode("utf-8", errors="replace")
    first = text.split("\n", 1)[0]
    head = _json_or_none(first)
    if isinstance(head, dict):
        kind = head.get("type") if isinstance(head.get("type"), str) else None
        if head.get("format") == "kvtrace-bundle":
            return Format.BUNDLE
        if kind in _CODEX_LINES and "payload" in head:
            return Format.CODEX
        if kind in _CLAUDE_CODE_LINES and ("sessionId" in head or "leafUuid" in head
                                           or "messageId" in head or "uuid" in head):
            return Format.CLAUDE_CODE
    document = _json_or_none(text) if len(data) <= _GUESS_BYTES else None
    if isinstance(document, dict):
        if isinstance(document.get("resourceSpans"), list):
            return Format.OTEL
        if "schema_version" in document and isinstance(document.get("steps"), list):
            return Format.ATIF
        if isinstance(document.get("messages"), list):
            return Format.OPENAI
    if isinstance(document, list) and document and all(
            isinstance(m, dict) and "role" in m for m in document[:5]):
        return Format.OPENAI
    return None


def _json_or_none(text: str) -> Any:
    """`text` as JSON, or None (the importer's own parser names what is wrong, and where)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _known(format: str) -> str:
    if format not in {f.value for f in Format}:
        choices = ", ".join(f.value for f in Format)
        raise UsageError(f"unknown format {format!r}: use one of {choices}")
    return format


def _document_format(format: str) -> Format:
    kind = Format(_known(format))
    if kind is Format.BUNDLE:
        raise UsageError("a bundle is not a JSON document: use import_file or export_file")
    return kind
