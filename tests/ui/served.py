"""What the UI tests share: hostile recorded runs, and a started UI with its client."""

from __future__ import annotations

import re
from typing import Any

import httpx

from tests.agent_runs import call, record_answer, record_calc_run

# Recorded content that would run script if a page ever let it through unescaped.
HOSTILE = ("</script><script>document.title = 'pwned'</script>"
           "<img src=x onerror=\"document.title = 'pwned'\"></pre></textarea>")
BIDI = "rm\u202e\u200bfdp.exe"


def record_hostile_runs(store: Any) -> None:
    """main: calc run + a hostile tool call and note; `fixed` forks main@1 with 392; `probe`."""
    main_run = store.run("main")
    record_calc_run(main_run)
    main_run.record_tool_call(BIDI, {"expr": HOSTILE}, HOSTILE, error="ZeroDivisionError")
    store.note("main@2", f"suspicious: {HOSTILE}", author="<supervisor>")
    record_answer(store.fork("main@1", "fixed"), "What is 17 * 23?", call("17 * 23"), "392")
    store.fork("main@3", "probe").record_note("looked here")


class RunningUi:
    """A started UI: its base URL, an httpx client, and the CSRF token its forms carry."""

    def __init__(self, ui: Any, server: Any) -> None:
        self.ui = ui
        self.server = server
        self.base = f"http://127.0.0.1:{server.port}"
        self.client = httpx.Client(base_url=self.base, timeout=30)

    def token(self, page: str = "/run?name=main") -> str:
        found = re.search(r'name="csrf" value="([^"]+)"', self.client.get(page).text)
        if found is None:
            raise AssertionError(f"{page} has no form with a CSRF token")
        return found.group(1)
