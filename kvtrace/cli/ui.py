"""`kvtrace ui`: the live web UI over the store, in the foreground (`kvtrace.ui.UiServer`).

Loopback only by default; another `--host` needs `--api-key` (`check_listening`,
the check `kvtrace serve` makes). The tokenizer for the oracle bound loads at
start (skip it with `--no-tokens`); the replay backend loads on the first replay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from kvtrace.cli.app import Json, Model, announce_conversion, app, print_json, say, store_url
from kvtrace.cli.serve import check_listening
from kvtrace.paths import default_cache_dir
from kvtrace.store import open_store

if TYPE_CHECKING:
    from kvtrace.replay import Backend

API_KEY_ENV = "KVTRACE_UI_API_KEY"


@app.command("ui")
def ui_command(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(
        "--host", help="Address to listen on (loopback only by default; another address needs "
        "--api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")]
    = 8765,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=API_KEY_ENV,
        help="Key a browser must log in with ($KVTRACE_UI_API_KEY); needed with a --host other "
        "than loopback.")] = None,
    model: Model = None,
    no_tokens: Annotated[bool, typer.Option(
        "--no-tokens", help="Load no tokenizer: step pages show no oracle bound.")] = False,
    no_replay: Annotated[bool, typer.Option(
        "--no-replay", help="Offer no replays (no model is ever loaded).")] = False,
    as_json: Json = False,
) -> None:
    """A live local web UI: runs, steps, diffs, live tails; note, pause, revert, fork, replay."""
    from kvtrace.serve import BackgroundServer
    from kvtrace.serve.app import check_api_key
    from kvtrace.ui import UiServer

    check_listening(host, port, api_key, env=API_KEY_ENV, what="UI")
    check_api_key(api_key, "--api-key")
    with open_store(store_url(ctx), create=False) as store:
        tokenizer = None
        if not no_tokens:
            from kvtrace.engine import load_tokenizer

            tokenizer = load_tokenizer(model, cache_dir=default_cache_dir(),
                                       on_convert=announce_conversion)

        def load_backend() -> Backend:
            from kvtrace.replay import open_local_backend

            # Requests come on any worker thread: the engine's own thread, which loads
            # it, is the one that keeps MKL's calls cheap (docs/batching.md).
            return open_local_backend(model, cache_dir=default_cache_dir(),
                                      on_convert=announce_conversion, batching=True)

        ui = UiServer(store, host=host, api_key=api_key, tokenizer=tokenizer,
                      tokenizer_name=tokenizer.name if tokenizer is not None else None,
                      load_backend=None if no_replay else load_backend)
        running = BackgroundServer(ui.app, host=host, port=port).start()
        url = f"http://{running.host}:{running.port}/"
        if as_json:
            print_json({"url": url, "store": store.display_url})
        say(f"kvtrace ui: {url} over {store.display_url}; Ctrl-C stops", err=True)
        try:
            running.wait_for_signal()
        finally:
            ui.close()  # open pages' streams end, so the server can stop
            running.stop()
