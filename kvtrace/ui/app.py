"""`kvtrace ui`'s ASGI application: pages, live streams and actions over one store.

Pages (GET, HTML drawn by views.py): `/` the runs, `/run?name=`, `/step?at=`,
`/diff?a=&b=`, `/tail?name=`, `/replay?id=`. Live streams (GET,
server-sent events): `/events/runs` (each run's head, polled from
`Store.runs`), `/events/tail?name=&since=` (the run's reflog through
`Store.watch`: a `step` event per append, a `move` per revert, fork, pause
...; the event id is the reflog cursor, so a reconnecting EventSource
resumes where it was), `/events/replay/ID` (a replay's progress). A stream
ends after `STREAM_SECONDS` (the browser reconnects at once) or when the
server closes, so stopping the server never waits on an open page.
Actions (POST, form-encoded): `/action/note`, `pause`, `resume`, `revert`,
`undo`, `fork` (with an edited field), `replay`; each is one call of the
store's (or replay's) public API, then a redirect (303) to the page that
shows its outcome.

Every request passes the guard (guard.py) first; every POST its CSRF
checks too, before anything is read or changed. Errors are pages with one
line: a kvtrace UsageError is a 400, a missing run or step a 404, a lost
compare-and-swap a 409, a refusal of the guard 401/403/421. Responses carry
a Content-Security-Policy whose script nonce is new per response; nothing
is loaded from elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import parse_qs

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtrace.errors import ConflictError, KvtraceError, NotFoundError, UsageError
from kvtrace.page import gather
from kvtrace.replay import Backend, ReplayMode
from kvtrace.replay.backend import Tokenizer
from kvtrace.store import Store
from kvtrace.store.kinds import StepKind
from kvtrace.store.present.compare import compare
from kvtrace.ui import live, views
from kvtrace.ui.guard import KEY_COOKIE, Guard, Refused
from kvtrace.ui.jobs import Jobs
from kvtrace.ui.views import Frame, link

STREAM_SECONDS = 30.0  # a stream's life; the browser's EventSource reconnects after it
RETRY_MS = 300  # how soon the browser reconnects
MAX_FORM_BYTES = 16 * 1024 * 1024
TAIL_STEPS = 50  # steps the tail page shows before the live ones
GRAPH_RUNS = 8  # runs whose branch graph the runs page draws
HEADS_POLL_S = 0.25
MAX_FLASHES = 256  # one-line outcomes of actions waiting for their redirect's page


def _csp(nonce: str) -> str:
    return ("default-src 'none'; style-src 'unsafe-inline'; "
            f"script-src 'nonce-{nonce}'; connect-src 'self'; img-src data:; "
            "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


class UiServer:
    """The UI over `store`: `app` is its ASGI application.

    `tokenizer` counts the oracle bound on step pages (None: no bound);
    `load_backend` makes the replay backend on the first replay (None: replay
    is refused with a clear message).
    """

    def __init__(self, store: Store, *, host: str = "127.0.0.1", api_key: str | None = None,
                 tokenizer: Tokenizer | None = None, tokenizer_name: str | None = None,
                 load_backend: Callable[[], Backend] | None = None) -> None:
        self.store = store
        self.guard = Guard(host=host, api_key=api_key)
        self.tokenizer = tokenizer
        self.tokenizer_name = tokenizer_name
        self.jobs = Jobs(store, load_backend)
        self._closing = threading.Event()
        self._flashes: dict[str, str] = {}
        self.app = self._build_app()

    def close(self) -> None:
        """End every open stream (within a second), so that the server can stop."""
        self._closing.set()

    # -- the application -------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        async def check(request: Request) -> None:
            if request.url.path == "/login":  # where a key is given: the host check only
                self.guard.check_host(request)
            else:
                self.guard.check_request(request)

        app = FastAPI(title="kvtrace ui", docs_url=None, redoc_url=None, openapi_url=None,
                      dependencies=[Depends(check)])

        @app.exception_handler(Refused)
        async def refused(request: Request, exc: Refused) -> Response:
            frame = self._frame(request)
            if exc.status == 401:
                return self._html(frame, views.login_page(frame, str(exc)), 401)
            return self._html(frame, views.error_page(frame, exc.status, str(exc)), exc.status)

        @app.exception_handler(KvtraceError)
        async def kvtrace_error(request: Request, exc: KvtraceError) -> Response:
            status = _status(exc)
            frame = self._frame(request)
            return self._html(frame, views.error_page(frame, status, str(exc)), status)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
            frame = self._frame(request)
            message = f"{request.method} {request.url.path}: {exc.detail}"
            return self._html(frame, views.error_page(frame, exc.status_code, message),
                              exc.status_code)

        self._pages(app)
        self._streams(app)
        self._actions(app)
        return app

    def _frame(self, request: Request) -> Frame:
        flash = self._flashes.pop(request.query_params.get("done", ""), None)
        return Frame(self.guard.csrf_token, secrets.token_urlsafe(16), flash)

    @staticmethod
    def _html(frame: Frame, text: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(text, status_code=status, headers={
            "Content-Security-Policy": _csp(frame.nonce), "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "same-origin", "X-Frame-Options": "DENY",
            "Cache-Control": "no-store"})

    # -- pages -----------------------------------------------------------------------------

    def _pages(self, app: FastAPI) -> None:
        store = self.store

        @app.get("/")
        def runs_page(request: Request) -> Response:
            runs = store.runs()
            paused = {r.name for r in runs if store.is_paused(r.name)}
            drawn = [r.name for r in runs if r.head_id][:GRAPH_RUNS]
            page = gather(store, drawn) if drawn else None
            frame = self._frame(request)
            return self._html(frame, views.runs_page(frame, runs, paused, page))

        @app.get("/run")
        def run_page(request: Request, name: str, page: int | None = None) -> Response:
            contents = gather(store, [name])
            moves = [e for e in store.reflog(name) if e.reason not in ("pause", "resume")]
            frame = self._frame(request)
            return self._html(frame, views.run_page(frame, name, contents,
                                                    store.is_paused(name), len(moves) > 1,
                                                    page))

        @app.get("/step")
        def step_page(request: Request, at: str) -> Response:
            return self._step_page(request, at)

        @app.get("/step.json")
        def step_json(at: str) -> Response:
            """The step whole, as `kvtrace show --json` prints it: the way to a value the page
            cuts (store/present/shown.py)."""
            step = store.show(at)
            body = {**step.to_dict(), "notes": [n.to_dict() for n in store.notes(step.id)]}
            return Response(json.dumps(body, ensure_ascii=False, indent=2),
                            media_type="application/json",
                            headers={"X-Content-Type-Options": "nosniff",
                                     "Cache-Control": "no-store"})

        @app.get("/diff")
        def diff_page(request: Request, a: str, b: str) -> Response:
            comparison = compare(store, a, b)
            frame = self._frame(request)
            return self._html(frame, views.diff_page(frame, comparison, store.path(a),
                                                     store.path(b)))

        @app.get("/tail")
        def tail_page(request: Request, name: str) -> Response:
            entries = store.reflog(name)  # before the steps: an append in between shows twice
            cursor = entries[0].id if entries else 0  # at most, and the page drops the copy
            steps = list(reversed(list(store.log(name, limit=TAIL_STEPS))))
            frame = self._frame(request)
            return self._html(frame, live.tail_page(frame, name, steps, cursor))

        @app.get("/replay")
        def replay_page(request: Request, id: int) -> Response:
            job = self.jobs.get(id)
            if job is None:
                raise UsageError(f"no replay {id} in this kvtrace ui (replays are kept until "
                                 "it stops)")
            frame = self._frame(request)
            return self._html(frame, live.replay_page(frame, job.snapshot()))

        @app.post("/login")
        async def login(request: Request) -> Response:
            form = await self._form(request)
            given = form.get("api_key", "")
            if not self.guard.is_key(given):
                raise Refused(401, "that is not this kvtrace ui's key")
            response = RedirectResponse("/", status_code=303)
            response.set_cookie(KEY_COOKIE, given, httponly=True, samesite="strict")
            return response

    def _run_of(self, spec: str) -> str | None:
        """The run a step address names (`RUN`, `RUN@N`, `RUN~K`), None for an id prefix."""
        name = re.split(r"[@~]", spec, maxsplit=1)[0]
        try:
            self.store.head(name)
        except KvtraceError:
            return None
        return name

    # -- live streams ----------------------------------------------------------------------

    def _streams(self, app: FastAPI) -> None:
        store = self.store

        @app.get("/events/runs")
        async def runs_events(request: Request) -> Response:
            async def events() -> AsyncIterator[str]:
                last: dict[str, Any] | None = None
                while await self._streaming(request):
                    heads = await run_in_threadpool(self._heads)
                    if heads != last:
                        yield live.sse("heads", heads)
                        last = heads
                    await asyncio.sleep(HEADS_POLL_S)
            return self._stream(events())

        @app.get("/events/tail")
        async def tail_events(request: Request, name: str, since: int = 0) -> Response:
            resumed = request.headers.get("last-event-id", "")
            cursor = int(resumed) if resumed.isdigit() else since
            await run_in_threadpool(store.head, name)  # an unknown run: 404 before streaming

            async def events() -> AsyncIterator[str]:
                nonlocal cursor
                while await self._streaming(request):
                    found = await run_in_threadpool(self._next_events, name, cursor)
                    for event in found:
                        cursor = event.cursor
                        if event.kind == "step" and event.step is not None:
                            row = views.step_row(name, views.plain_item(event.step))
                            yield live.sse("step", {"id": event.step.id, "row": row},
                                            ident=event.cursor)
                        else:
                            yield live.sse("move", {"kind": event.kind, "message":
                                                     event.message}, ident=event.cursor)
            return self._stream(events())

        @app.get("/events/replay/{job_id}")
        async def replay_events(request: Request, job_id: int) -> Response:
            job = self.jobs.get(job_id)
            if job is None:
                raise UsageError(f"no replay {job_id} in this kvtrace ui")

            async def events() -> AsyncIterator[str]:
                seen = -1
                while await self._streaming(request):
                    snapshot = job.snapshot()
                    if snapshot["done"] != seen or job.is_over:
                        seen = snapshot["done"]
                        yield live.sse("progress", snapshot)
                    if job.is_over:
                        return
                    await run_in_threadpool(job.wait_change, seen, 1.0)
            return self._stream(events())

    def _heads(self) -> dict[str, Any]:
        runs = self.store.runs()
        return live.heads_event(runs, {r.name for r in runs if self.store.is_paused(r.name)})

    def _next_events(self, name: str, cursor: int) -> list[Any]:
        """The events of run `name` after `cursor`, waiting up to a second for the first."""
        events = self.store.watch(name, since=cursor, timeout=1.0, poll_interval=0.05)
        try:
            for event in events:
                return [event]  # one at a time: the next call resumes after its cursor
            return []
        finally:
            close = getattr(events, "close", None)  # a generator: its PostgreSQL LISTEN
            if callable(close):  # connection closes now, not when it is collected
                close()

    async def _streaming(self, request: Request) -> bool:
        if self._closing.is_set():
            return False
        return not await request.is_disconnected()

    def _stream(self, events: AsyncIterator[str]) -> StreamingResponse:
        async def bounded() -> AsyncIterator[str]:
            yield f"retry: {RETRY_MS}\n\n"
            deadline = time.monotonic() + STREAM_SECONDS
            async for chunk in events:
                yield chunk
                if time.monotonic() > deadline:
                    return
        return StreamingResponse(bounded(), media_type="text/event-stream", headers={
            "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    # -- actions ---------------------------------------------------------------------------

    def _actions(self, app: FastAPI) -> None:
        store = self.store

        @app.post("/action/{action}")
        async def act(request: Request, action: str) -> Response:
            form = await self._form(request)
            self.guard.check_post(request, form)  # before anything is read or changed
            handler = handlers.get(action)
            if handler is None:
                raise UsageError(f"no action {action!r}: use one of {', '.join(handlers)}")
            try:
                where, message = await run_in_threadpool(handler, form)
            except KvtraceError as exc:
                if action != "fork" or not form.get("at"):
                    raise
                draft = views.Draft(form.get("name", ""),
                                    form.get("value", "").replace("\r\n", "\n"), str(exc))
                return await run_in_threadpool(self._step_page, request, form["at"],
                                               draft=draft, status=_status(exc))
            done = secrets.token_urlsafe(8)
            while len(self._flashes) >= MAX_FLASHES:  # redirects never followed: drop the oldest
                self._flashes.pop(next(iter(self._flashes)))
            self._flashes[done] = message
            separator = "&" if "?" in where else "?"
            return RedirectResponse(f"{where}{separator}done={done}", status_code=303)

        def note(form: dict[str, str]) -> tuple[str, str]:
            at = _field(form, "at")
            added = store.note(at, _field(form, "text"), form.get("author") or None)
            return link("/step", at=form.get("back") or at), f"note {added.id} added"

        def pause(form: dict[str, str]) -> tuple[str, str]:
            run = _field(form, "run")
            store.pause(run, reason="paused from kvtrace ui")
            return link("/run", name=run), f"{run} paused: appends wait for a resume"

        def resume(form: dict[str, str]) -> tuple[str, str]:
            run = _field(form, "run")
            store.resume(run, reason="resumed from kvtrace ui")
            return link("/run", name=run), f"{run} resumed"

        def revert(form: dict[str, str]) -> tuple[str, str]:
            run, to = _field(form, "run"), _field(form, "to")
            target = to if not to.isdigit() else f"{run}@{to}"
            head = store.revert(run, to=target)
            return (link("/run", name=run),
                    f"{run} reverted to @{head.depth} (undo brings the steps back)")

        def undo(form: dict[str, str]) -> tuple[str, str]:
            run = _field(form, "run")
            head = store.undo(run)
            depth = head.depth if head is not None else 0
            return link("/run", name=run), f"undid the last move of {run}: head at @{depth}"

        def fork(form: dict[str, str]) -> tuple[str, str]:
            at, name, field = _field(form, "at"), _field(form, "name"), _field(form, "field")
            text = form.get("value", "").replace("\r\n", "\n")  # a textarea sends CRLF
            value: Any = text
            if form.get("as_text") != "1":
                try:
                    value = json.loads(text)
                except ValueError as exc:
                    raise UsageError(f"value is not JSON ({exc}): the {field} of this step is "
                                     "JSON, so its edit must be too", param="value") from exc
            run = store.fork(at, name, edit={field: value})
            head = run.head
            depth = head.depth if head is not None else 0
            return (link("/step", at=f"{run.name}@{depth}"),
                    f"forked {run.name} with an edited {field}")

        def replay(form: dict[str, str]) -> tuple[str, str]:
            run = _field(form, "run")
            job = self.jobs.start(run, ReplayMode(_choice(form, "mode", list(ReplayMode))))
            return link("/replay", id=str(job.id)), f"{job.mode} of {run} started"

        handlers: dict[str, Callable[[dict[str, str]], tuple[str, str]]] = {
            "note": note, "pause": pause, "resume": resume, "revert": revert, "undo": undo,
            "fork": fork, "replay": replay}

    def _step_page(self, request: Request, at: str, *, draft: views.Draft | None = None,
                   status: int = 200) -> Response:
        """Step `at`'s page; with `draft`, its fork form holds what a failed fork was sent
        (the name and the edit), under the error, so that nothing typed is lost."""
        page = gather(self.store, [at], self.tokenizer, tokenizer_name=self.tokenizer_name)
        steps = page.runs[0].steps
        if not steps:
            raise UsageError(f"{at!r} is an empty run: it has no step to show")
        item = steps[-1]
        previous = next((s for s in reversed(steps[:-1])
                         if s.step.kind == StepKind.MODEL_CALL), None)
        frame = self._frame(request)
        return self._html(frame, views.step_page(
            frame, at, self._run_of(at), item,
            previous if item.step.kind == StepKind.MODEL_CALL else None,
            self.jobs.last_step_report(item.step.id), draft), status)

    async def _form(self, request: Request) -> dict[str, str]:
        """A form-encoded body as a dict (the last value of a repeated field), size-capped."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/x-www-form-urlencoded":
            raise Refused(403, "refused a POST that is not a form of this page "
                          f"(Content-Type {kind or 'missing'})")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_FORM_BYTES:
                raise UsageError(f"the form is over {MAX_FORM_BYTES} bytes")
            chunks.append(chunk)
        try:
            parsed = parse_qs(b"".join(chunks).decode("utf-8"), keep_blank_values=True,
                              strict_parsing=False)
        except UnicodeDecodeError as exc:
            raise UsageError("the form is not UTF-8") from exc
        return {key: values[-1] for key, values in parsed.items()}


def _field(form: dict[str, str], name: str) -> str:
    value = form.get(name, "").strip()
    if not value:
        raise UsageError(f"{name} is missing: fill it in", param=name)
    return value


def _choice(form: dict[str, str], name: str, choices: list[str]) -> str:
    value = _field(form, name)
    if value not in choices:
        raise UsageError(f"{name} {value!r} is not one of {', '.join(choices)}", param=name)
    return value


def _status(exc: KvtraceError) -> int:
    """The HTTP status of an error: bad input 400, unknown 404, a conflict 409, else 500."""
    return (400 if isinstance(exc, UsageError) else 404 if isinstance(exc, NotFoundError)
            else 409 if isinstance(exc, ConflictError) else 500)
