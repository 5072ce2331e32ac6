"""The UI served for real: `UiServer` on uvicorn on a free loopback port, over a real store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.ui.served import RunningUi


@pytest.fixture
def start_ui() -> Iterator[Callable[..., RunningUi]]:
    """`start_ui(store, **options)`: a UiServer over `store`, served until the test ends."""
    from kvtrace.serve import BackgroundServer
    from kvtrace.ui import UiServer

    started: list[RunningUi] = []

    def start(store: Any, **options: Any) -> RunningUi:
        ui = UiServer(store, **options)
        running = RunningUi(ui, BackgroundServer(ui.app).start())
        started.append(running)
        return running

    yield start
    for running in started:
        running.client.close()
        running.ui.close()
        running.server.stop()
