"""The public surface is explicit and pinned."""

from __future__ import annotations

import kvtrace


def test_public_names_are_pinned():
    assert sorted(kvtrace.__all__) == sorted(
        [
            "ConflictError",
            "FsckReport",
            "IntegrityError",
            "KvtraceError",
            "Note",
            "NotFoundError",
            "ReflogEntry",
            "RetryableError",
            "Run",
            "RunInfo",
            "RunPausedError",
            "Step",
            "Store",
            "UsageError",
            "WatchEvent",
            "__version__",
            "open_store",
            "recording",
            "replaying",
            "tool",
        ]
    )


def test_every_public_name_exists():
    for name in kvtrace.__all__:
        assert hasattr(kvtrace, name), name


def test_store_methods_of_the_contract_exist():
    for method in (
        "run",
        "fork",
        "watch",
        "pause",
        "resume",
        "revert",
        "reset",
        "log",
        "show",
        "note",
        "reflog",
        "fsck",
        "export_run",
        "import_bundle",
    ):
        assert callable(getattr(kvtrace.Store, method)), method
    for method in ("record_model_call", "record_tool_call"):
        assert callable(getattr(kvtrace.Run, method)), method
