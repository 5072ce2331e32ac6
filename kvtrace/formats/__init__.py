"""Trajectories in and out: other tools' formats converted to and from a run's steps.

One module per format, each converting a whole document to the store's
records and back (`import_X(store, document, *, run)`, `export_X(store,
spec)`): `openai.py` (a list of chat messages), `atif.py` (Harbor's Agent
Trajectory Interchange Format) and `otel.py` / `otel_import.py`
(OpenTelemetry OTLP-JSON spans with the GenAI conventions). Bundles,
kvtrace's own lossless format, stay in the store (`Store.export_run`,
`Store.import_bundle`). This module picks one by name for the CLI and for
programs; docs/formats.md has the mappings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import StrEnum
from typing import IO, Any

from kvtrace.errors import UsageError
from kvtrace.formats.atif import atif_records, export_atif, import_atif
from kvtrace.formats.openai import export_openai, import_openai, openai_records
from kvtrace.formats.otel import export_otel
from kvtrace.formats.otel_import import import_otel, otel_records
from kvtrace.formats.records import parse_json
from kvtrace.store import RunInfo, Store, validate_run_name

__all__ = [
    "Format",
    "atif_records",
    "default_run_name",
    "export_atif",
    "export_document",
    "export_file",
    "export_openai",
    "export_otel",
    "import_atif",
    "import_document",
    "import_file",
    "import_openai",
    "import_otel",
    "openai_records",
    "otel_records",
]


class Format(StrEnum):
    """The formats `kvtrace import` and `kvtrace export` read and write."""

    BUNDLE = "bundle"
    OPENAI = "openai"
    ATIF = "atif"
    OTEL = "otel"


_IMPORTERS: dict[Format, Callable[..., RunInfo]] = {
    Format.OPENAI: import_openai,
    Format.ATIF: import_atif,
    Format.OTEL: import_otel,
}
_EXPORTERS: dict[Format, Callable[[Store, str], Any]] = {
    Format.OPENAI: export_openai,
    Format.ATIF: export_atif,
}


def import_document(store: Store, document: Any, *, format: str, run: str) -> RunInfo:
    """Record a parsed JSON document of `format` (openai, atif or otel) as the new run `run`."""
    return _IMPORTERS[_document_format(format)](store, document, run=run)


def export_document(
    store: Store, spec: str, *, format: str, include_content: bool = False
) -> Any:
    """The run up to `spec` as a JSON document of `format` (openai, atif or otel).

    `include_content` puts prompts, responses, tool arguments and results
    into OTel spans (they are left out by default); the other formats always
    carry them.
    """
    kind = _document_format(format)
    if kind is Format.OTEL:
        return export_otel(store, spec, include_content=include_content)
    return _EXPORTERS[kind](store, spec)


def import_file(
    store: Store, file: IO[bytes], *, format: str = Format.BUNDLE, run: str | None = None,
    filename: str | None = None,
) -> RunInfo:
    """Import a file of any format; nothing is written unless the whole file is good.

    `run` defaults to the bundle's own run, or for openai and atif to the
    file's name without its extensions (`default_run_name`).
    """
    kind = Format(_known(format))
    if kind is Format.BUNDLE:
        return store.import_bundle(file, name=run)
    source = filename or "the file"
    if run is None:
        if filename is None:
            raise UsageError("name the run to import into")
        run = default_run_name(filename)
    return import_document(store, parse_json(file.read(), source), format=kind, run=run)


def export_file(
    store: Store, spec: str, file: IO[bytes], *, format: str = Format.BUNDLE,
    include_content: bool = False,
) -> None:
    """Write the run `spec` in any format (a bundle takes a run name; the others any step)."""
    kind = Format(_known(format))
    if include_content and kind is not Format.OTEL:
        raise UsageError("include_content applies to the otel format only (the others always "
                         "carry the content)")
    if kind is Format.BUNDLE:
        store.export_run(spec, file)
        return
    document = export_document(store, spec, format=kind, include_content=include_content)
    file.write(json.dumps(document, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")


def default_run_name(filename: str) -> str:
    """The run a file imports into by default: its name up to the first dot."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1].split(".", 1)[0]
    try:
        return validate_run_name(name)
    except UsageError as exc:
        raise UsageError(f"{exc}; name the run yourself (run=NAME)", param="run") from exc


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
