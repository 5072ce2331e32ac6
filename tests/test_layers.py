"""Layers import one way: store -> formats, engine -> replay -> tracer, page -> cli (as dulwich)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvtrace"

# A layer may import itself, the shared modules, and the layers listed for it.
SHARED = {"kvtrace.errors", "kvtrace.paths", "kvtrace.rendering", "kvtrace.numerics"}
ALLOWED = {
    "store": {"store"},
    "engine": {"engine"},
    "replay": {"replay", "store", "engine"},
    "formats": {"formats", "store"},
    "tracer": {"tracer", "store", "engine", "replay"},
    "page": {"page", "store", "replay"},
    "bench": {"bench", "store", "engine", "replay", "formats", "tracer"},
    "cli": {"cli", "store", "engine", "replay", "bench", "formats", "tracer", "page"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n == "kvtrace" or n.startswith("kvtrace.")}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_lower_layers_never_import_higher_ones(layer):
    folder = PACKAGE / layer
    assert folder.is_dir(), f"layer {layer} has no folder"
    files = list(folder.rglob("*.py"))
    assert files, f"layer {layer} has no modules"
    for path in files:
        for name in _imports(path):
            if name in SHARED:
                continue
            parts = name.split(".")
            target = parts[1] if len(parts) > 1 else "kvtrace"
            assert target in ALLOWED[layer], f"{path.relative_to(PACKAGE)} imports {name}"


def test_only_the_cli_formats_output_with_rich():
    """The library returns records; tables and progress bars are drawn at the edge."""
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "cli":
            continue
        tree = ast.parse(path.read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names}
        modules |= {node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module}
        assert not {m for m in modules if m == "rich" or m.startswith("rich.")}, (
            f"{path.relative_to(PACKAGE)} imports rich: return a record, render it in kvtrace/cli"
        )
