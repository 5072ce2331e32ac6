"""Layers import one way: apis -> store -> formats, tracer, workspace; engine -> replay ->
serve; page, mcp, ui -> cli (as dulwich)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvtrace"

# A layer may import itself, the shared modules, and the layers listed for it.
SHARED = {"kvtrace.errors", "kvtrace.paths", "kvtrace.rendering", "kvtrace.inert",
          "kvtrace.extras"}
ALLOWED = {
    "apis": {"apis"},
    "store": {"store", "apis"},
    "engine": {"engine"},
    "replay": {"replay", "apis", "store", "engine"},
    "formats": {"formats", "apis", "store"},
    "tracer": {"tracer", "apis", "store"},
    "workspace": {"workspace", "store"},
    "serve": {"serve", "apis", "tracer", "store", "replay", "workspace"},
    "page": {"page", "apis", "store", "replay"},
    "mcp": {"mcp", "apis", "store", "engine", "replay", "serve", "workspace"},
    "bench": {"bench", "apis", "store", "engine", "replay", "formats", "tracer", "serve",
              "workspace"},
    "ui": {"ui", "apis", "page", "store", "replay", "serve"},
    "cli": {"cli", "apis", "store", "engine", "replay", "bench", "formats", "tracer", "serve",
            "page", "mcp", "ui", "workspace"},
}
# The package's own module re-exports the public surface: the light layers only, so that
# `import kvtrace` loads neither torch nor the server.
PACKAGE_INIT_ALLOWED = {"apis", "store", "tracer"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n == "kvtrace" or n.startswith("kvtrace.")}


def _layer(name: str) -> str:
    """The layer a module belongs to: `kvtrace.store.run` -> `store`."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "kvtrace"


def test_every_subpackage_is_a_layer():
    folders = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert folders == set(ALLOWED)


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
            assert _layer(name) in ALLOWED[layer], f"{path.relative_to(PACKAGE)} imports {name}"


@pytest.mark.parametrize("module", sorted(SHARED))
def test_shared_modules_import_no_layer(module):
    path = PACKAGE / f"{module.removeprefix('kvtrace.')}.py"
    names = _imports(path) - SHARED
    assert not names, f"{path.relative_to(PACKAGE)} imports {sorted(names)}"


def test_the_package_module_imports_only_the_light_layers():
    for name in _imports(PACKAGE / "__init__.py") - SHARED:
        assert _layer(name) in PACKAGE_INIT_ALLOWED, f"__init__.py imports {name}"


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


def _runtime_imports(path: Path) -> set[str]:
    """The kvtrace modules `path` imports when it runs (inside functions too), less those
    under `if TYPE_CHECKING:`, which never run."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for node in ast.walk(block)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("kvtrace.")}


def test_no_module_imports_itself_round_a_circle():
    """A package's `__init__` re-exports its modules (a facade, as dulwich's); every other
    module imports one way, so any of them can be read, and loaded, before the ones above."""
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p
               for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    graph = {name: _runtime_imports(path) & set(modules) - {name}
             for name, path in modules.items()}
    circles: list[str] = []
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            circles.append(" -> ".join([*trail[trail.index(name):], name]))
            return
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert circles == [], "import circles: " + "; ".join(circles)


def test_the_engine_package_loads_torch_only_when_a_name_that_needs_it_is_used():
    """`SamplingParams` lives in the engine, and the CLI's light path names it: importing the
    package must not load torch. Each other name comes from its module on first use, and a
    submodule imported first never stands in for the function of a like name."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import kvtrace.cli.app, kvtrace.replay\n"
        "from kvtrace.engine import SamplingParams\n"
        "assert 'torch' not in sys.modules, 'torch loaded'\n"
        "assert SamplingParams(temperature=0.5).is_greedy is False\n"
        "import kvtrace.engine.generation, kvtrace.engine.prefilling\n"
        "from kvtrace.engine import KVCache, generate, prefill\n"
        "assert callable(generate) and callable(prefill) and isinstance(KVCache, type)\n"
        "assert generate.__module__ == 'kvtrace.engine.generation'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
