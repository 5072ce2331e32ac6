"""A converted GGUF is cached under its content hash (issue 11, item 11): two different
files with the same name never load as one model."""

from __future__ import annotations

import hashlib

import pytest

from kvtrace.engine.folders import model_folder
from kvtrace.errors import UsageError


def test_two_gguf_files_of_the_same_name_never_share_a_converted_folder(tmp_path):
    root = tmp_path / "cache"
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path, content in ((first, b"GGUF first model"), (second, b"GGUF second model")):
        path.parent.mkdir()
        path.write_bytes(content)
    # The first file's conversion, as an earlier load left it (converting takes ~30 s).
    digest = hashlib.sha256(first.read_bytes()).hexdigest()
    converted = root / "models" / f"model-{digest[:16]}"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")

    assert model_folder(first, root) == converted
    # The second file is converted on its own (and, not being a real GGUF, refused):
    # never served the first file's folder.
    with pytest.raises(UsageError, match="as a GGUF model"):
        model_folder(second, root)
    assert sorted(p.name for p in (root / "models").iterdir()) == [converted.name]
