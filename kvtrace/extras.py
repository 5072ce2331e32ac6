"""The optional parts of kvtrace (pip extras), and which one brings a module a light install
lacks.

The base install is the recording SDK and the store's CLI (the tracer, import and export,
log, show, diff): a few small libraries, no torch. Replaying through a model, serving,
MCP and the live UI each come with an extra, and `pip install 'kvtrace[all]'` brings them
all. A command that reaches for a module of an extra not installed is told, in one line,
which extra to install (the CLI's `main`).
"""

from __future__ import annotations

# The top-level modules each extra installs, as `import` names them.
EXTRAS = {
    "engine": ("torch", "transformers", "safetensors", "gguf", "accelerate", "psutil"),
    "serve": ("fastapi", "uvicorn", "starlette"),
    "ui": ("fastapi", "uvicorn", "starlette"),
    "mcp": ("mcp",),
}


def missing_extra(error: ModuleNotFoundError, command: str | None = None) -> str | None:
    """The one line that names the extra to install for `error`, or None when the missing
    module is not one an extra brings (then it is a bug, not a choice of install)."""
    module = (error.name or "").partition(".")[0]
    extras = [extra for extra, modules in EXTRAS.items() if module in modules]
    if not extras:
        return None
    extra = command if command in extras else extras[0]  # `kvtrace ui`: the ui extra
    what = f"kvtrace {command}" if command else "this"
    return (f"{what} needs the '{extra}' extra ({module} is not installed): "
            f"pip install 'kvtrace[{extra}]'")
