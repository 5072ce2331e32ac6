"""`kvtrace ui`: a live local web app over a trace store, to look at runs and steer them.

    ui = UiServer(store, tokenizer=..., load_backend=...)   # app.py
    BackgroundServer(ui.app).start()                         # kvtrace.serve's uvicorn thread

Server-rendered HTML (views.py, drawn with `kvtrace report`'s helpers and
escaping) with one small inline script per page, live through server-sent
events (`Store.watch`, replay progress from jobs.py); actions are forms,
each one call of the public API. guard.py decides who may use it and which
POSTs are the person's own. No Node build step, nothing loaded from
elsewhere. See docs/ui.md.
"""

from __future__ import annotations

from kvtrace.ui.app import UiServer
from kvtrace.ui.guard import Guard, Refused
from kvtrace.ui.jobs import JobState, ReplayJob

__all__ = ["Guard", "JobState", "Refused", "ReplayJob", "UiServer"]
