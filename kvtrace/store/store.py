"""The trace store: content-addressed steps and blobs, runs as refs, a reflog.

`Store` is the facade (as dulwich's Repo over its object store and refs
container), each job in a module of its own: appending steps with the
caches that make an append cost what it adds (writer.py, `StepWriter`),
the transaction each write runs in, batches too (transactions.py), blobs
and steps addressed by SHA-256 (encoding.py), refs moved only by
compare-and-swap (refs.py, which also appends the reflog), notes (notes.py)
and step addresses (resolve.py). Every public method is one transaction, so
a failure leaves nothing half-written.

Cost model: appending, forking and moving a ref touch a constant number of
rows; walking history (log, RUN@N, ancestry checks) is one recursive query
bounded by the distance walked, never by the size of the store.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import IO, TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from kvtrace.errors import (
    ConflictError,
    RunNotFoundError,
    StepNotFoundError,
    UsageError,
)
from kvtrace.store import notes as step_notes
from kvtrace.store import validation
from kvtrace.store.db.backend import (
    insert_ignore,
    read_transaction,
    reader,
    retried,
    safe_url,
    writer,
)
from kvtrace.store.db.schema import (
    PAUSE_REASONS,
    blobs,
    reflog,
    refs,
    steps,
)
from kvtrace.store.kinds import EDIT_OF, MEASUREMENTS, ModelCall, StepKind
from kvtrace.store.names import normalize_run_name, validate_run_name
from kvtrace.store.objects import bodies, codec, encoding, graph, history, resolve
from kvtrace.store.objects import lists as store_lists
from kvtrace.store.objects.refs import (
    create_ref,
    last_logged,
    move_ref,
    pause_entry,
    set_paused,
)
from kvtrace.store.objects.transactions import Transactions
from kvtrace.store.objects.writer import StepWriter
from kvtrace.store.records import (
    Divergence,
    FsckReport,
    GraphRow,
    Growth,
    Note,
    ReflogEntry,
    RunInfo,
    Step,
)

if TYPE_CHECKING:
    from kvtrace.store.run import Run
    from kvtrace.store.watch import WatchEvent

# Told as a long read or write goes: (steps done, steps in all); what a progress bar shows.
OnStep = Callable[[int, int], None]
T = TypeVar("T")

_PAGE = 64  # steps a walk reads per query round (a page of a long run's steps in memory)


class Store:
    """A trace store on one database (SQLite file or PostgreSQL)."""

    def __init__(self, engine: Engine, url: str) -> None:
        """Use `open_store`, which also migrates the schema."""
        self._engine = engine
        self._tx = Transactions(writer(engine))  # every write's transaction, batches too
        self._write = self._tx.write
        self._reader = reader(engine)
        self._steps = StepWriter(self._tx.write, self._tx.batch_moves)  # appends, its caches
        # Record a step after `parent` and move run `name` onto it, atomically (used by Run;
        # StepWriter.append says how), called again where the database aborted it.
        self.append = retried(self._steps.append)
        self.url = url

    @property
    def display_url(self) -> str:
        """The URL with any password masked, for output."""
        return safe_url(self.url)

    # -- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Release database connections."""
        self._tx.close()
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for tools such as benchmarks and tests)."""
        return self._engine

    def batch(self) -> AbstractContextManager[None]:
        """Run every write inside in one transaction: all of it lands, or none of it
        (transactions.py says how: one thread's batch, its ref moves made at its end)."""
        return self._tx.batch()

    # -- runs ------------------------------------------------------------------

    @retried
    def run(self, name: str) -> Run:
        """The run `name`, created empty if it does not exist yet."""
        from kvtrace.store.run import Run

        name = validate_run_name(name)
        with read_transaction(self._reader) as conn:  # continuing a run needs no write lock
            row = resolve.ref_row(conn, name)
            if row is not None:
                head = (history.load_steps(conn, [row.head], self._lists_cache())[0]
                        if row.head else None)
                return Run(self, name, head)
        try:
            with self._write() as conn:
                create_ref(conn, name, None, reason="create", message="new run")
            return Run(self, name, None)
        except ConflictError:  # another writer created it since our read: continue it
            return Run(self, name, self.head(name))

    def runs(
        self, *, limit: int | None = None, after: str | None = None, prefix: str | None = None
    ) -> list[RunInfo]:
        """Runs by name: every run, or a page of at most `limit` whose names sort after
        `after` (the last name of the previous page), or those whose names start with `prefix`.

        A page reads `limit` rows of the name index, however many runs the
        store holds (names sort as the database sorts them).
        """
        limit = validation.check_limit(limit)
        query = (
            sa.select(refs.c.name, refs.c.head, refs.c.created_at, steps.c.depth)
            .select_from(refs.outerjoin(steps, steps.c.id == refs.c.head))
            .order_by(refs.c.name)
        )
        if after is not None:
            query = query.where(refs.c.name > normalize_run_name(after))
        if prefix is not None:  # exact on every collation; a scan of the names, not of steps
            prefix = normalize_run_name(prefix)
            query = query.where(sa.func.substr(refs.c.name, 1, len(prefix)) == prefix)
        if limit is not None:
            query = query.limit(limit)
        with read_transaction(self._reader) as conn:
            rows = conn.execute(query).all()
        return [RunInfo(r.name, r.head, r.depth or 0, r.created_at) for r in rows]

    def run_info(self, name: str) -> RunInfo:
        """Run `name` as `runs` lists it (RunNotFoundError if there is none): one row."""
        name = normalize_run_name(name)
        with read_transaction(self._reader) as conn:
            row = conn.execute(
                sa.select(refs.c.name, refs.c.head, refs.c.created_at, steps.c.depth)
                .select_from(refs.outerjoin(steps, steps.c.id == refs.c.head))
                .where(refs.c.name == name)
            ).first()
        if row is None:
            raise RunNotFoundError(f"no run named {name!r} (see `kvtrace runs`)")
        return RunInfo(row.name, row.head, row.depth or 0, row.created_at)

    def has_run(self, name: str) -> bool:
        """Whether a run is named `name` (an empty run counts): one row of the name index."""
        name = normalize_run_name(name)
        with read_transaction(self._reader) as conn:
            return resolve.ref_row(conn, name) is not None

    def head(self, name: str) -> Step | None:
        """The head step of run `name` (None for an empty run)."""
        with read_transaction(self._reader) as conn:
            head_id = resolve.head_id(conn, name)
            return history.load_steps(conn, [head_id], self._lists_cache())[0] if head_id else None

    # -- reading ---------------------------------------------------------------

    def resolve(self, spec: str) -> str:
        """The full id of the step that `spec` addresses."""
        with read_transaction(self._reader) as conn:
            return resolve.step_id(conn, spec)

    def show(self, spec: str) -> Step:
        """The step that `spec` addresses, with its content."""
        with read_transaction(self._reader) as conn:
            return history.load_steps(conn, [resolve.step_id(conn, spec)], self._lists_cache())[0]

    def held(self) -> dict[str, int]:
        """What the store holds in memory (writer.py's caches: steps known, lists resolved,
        their item addresses), for a long-lived process's memory accounting."""
        return self._steps.held()

    def _lists_cache(self) -> store_lists.ListCache:
        """The resolved-list cache the writer keeps, emptied first when it is full (readers
        fill it too: a process that only reads, a watcher or the UI, must not hold every
        list it met)."""
        return self._steps.lists_cache()

    def log(self, spec: str, *, limit: int | None = None, lists: bool = True
            ) -> Iterator[Step]:
        """Steps from `spec` (a run means its head) back to the root, head first.

        Errors (an unknown run, say) are raised here, not on first iteration.
        Steps are read a page at a time as the iterator goes (see `walk`).
        With `lists=False` a step's list fields (a model call's conversation)
        are left out of its content (`ModelCall.has_messages` is False): a
        listing of a long run then reads each step's own fields only.
        """
        limit = validation.check_limit(limit)
        with read_transaction(self._reader) as conn:
            start = resolve.step_id_or_empty(conn, spec)
            chain = history.chain(conn, start, limit) if start else []
        return self._pages(chain, None, self._loader(lists))

    def walk(self, spec: str, *, on_step: OnStep | None = None, lists: bool = True
             ) -> Iterator[Step]:
        """Steps from the root to `spec`, in order, read a page at a time as the iterator goes.

        What a reader of a long run takes instead of `path`: memory holds one
        page of steps and the run's messages decoded once (steps share them),
        not every step's copy of its history. `on_step(done, total)` is told
        as each step is read (a progress bar); `lists` as for `log`. Errors are
        raised here.
        """
        with read_transaction(self._reader) as conn:
            start = resolve.step_id_or_empty(conn, spec)
            chain = history.chain(conn, start, None) if start else []
        chain.reverse()
        return self._pages(chain, on_step, self._loader(lists))

    def walk_growth(self, spec: str, *, on_step: OnStep | None = None
                    ) -> Iterator[tuple[Step, dict[str, Growth]]]:
        """`walk` without list fields in the steps' content, each step with how its lists grow
        the previous ones (`Growth`: a model call's new messages).

        What a reader that shows each call's new messages takes (the report):
        a run of n calls costs its messages, not n copies of its history.
        """
        with read_transaction(self._reader) as conn:
            start = resolve.step_id_or_empty(conn, spec)
            chain = history.chain(conn, start, None) if start else []
        chain.reverse()
        last: dict[str, tuple[str, store_lists.Resolved]] = {}
        return self._pages(chain, on_step, lambda conn, ids: history.load_growth(
            conn, ids, self._lists_cache(), last))

    def _pages(self, ids: list[str], on_step: OnStep | None,
               load: Callable[[Connection, list[str]], list[T]]) -> Iterator[T]:
        """What `load` makes of the steps `ids`, _PAGE at a time (steps never change: any
        later read is right)."""
        for start in range(0, len(ids), _PAGE):
            with read_transaction(self._reader) as conn:
                page = load(conn, ids[start:start + _PAGE])
            for done, item in enumerate(page, start=start + 1):
                if on_step is not None:
                    on_step(done, len(ids))
                yield item

    def _loader(self, lists: bool) -> Callable[[Connection, list[str]], list[Step]]:
        """Loads pages of steps for one walk (its decoded items shared by all its pages)."""
        decoded = store_lists.Decoded()
        return lambda conn, ids: history.load_steps(conn, ids, self._lists_cache(), decoded,
                                                    with_lists=lists)

    def graph(self, spec: str, *, limit: int | None = None) -> list[GraphRow]:
        """`log` plus, per step, the runs whose head it is and the branches (runs) leaving it."""
        limit = validation.check_limit(limit)
        with read_transaction(self._reader) as conn:
            start = resolve.step_id_or_empty(conn, spec)
            return graph.graph_rows(conn, history.chain(conn, start, limit) if start else [])

    def forks(self, spec: str) -> list[tuple[str, int]]:
        """The runs that leave the history of `spec`: (run, depth of the step it leaves from),
        by depth then name. Reads no step content (what `graph` tells, for a long run)."""
        with read_transaction(self._reader) as conn:
            start = resolve.step_id_or_empty(conn, spec)
            return graph.forks(conn, history.chain(conn, start, None)) if start else []

    def path(self, spec: str) -> list[Step]:
        """Steps from the root to `spec`, in order (what replay walks; see `walk`)."""
        return list(self.walk(spec))

    def diverge(self, a: str, b: str) -> Divergence:
        """Where the histories of `a` and `b` part (like `git merge-base`)."""
        with read_transaction(self._reader) as conn:
            chains = []
            for spec in (a, b):
                start = resolve.step_id_or_empty(conn, spec)
                chains.append(list(reversed(history.chain(conn, start, None))) if start else [])
            return graph.divergence(conn, *chains)

    def read_blob(self, address: str) -> bytes:
        """The bytes stored at `address`."""
        return self.read_blobs([address])[address]

    def read_blobs(self, addresses: list[str]) -> dict[str, bytes]:
        """The bytes stored at each of `addresses` (a StepNotFoundError names one missing)."""
        with read_transaction(self._reader) as conn:
            found = codec.read(conn, addresses)
        missing = [address for address in addresses if address not in found]
        if missing:
            raise StepNotFoundError(f"no blob {missing[0][:12]} in the store")
        return found

    @retried
    def write_blobs(self, contents: list[bytes], *, base: codec.Base | None = None
                    ) -> list[str]:
        """Keep each of `contents` as a blob (those held already are left as they are); their
        addresses. `base`: a stored blob they may be kept as deltas against (codec.py).

        For content no step names in its payload: a workspace snapshot's files
        and trees (kvtrace/workspace), which a model call's meta names."""
        rows = {encoding.sha256_hex(content): content for content in contents}
        with self._write() as conn:
            insert_ignore(conn, blobs, [codec.row(address, content, base)
                                        for address, content in rows.items()], "hash")
        return list(rows)

    # -- moving refs -----------------------------------------------------------

    @retried
    def fork(
        self, spec: str, new_name: str, *, edit: Mapping[str, Any] | None = None
    ) -> Run:
        """A new run `new_name` whose head is the step `spec` (O(1): one ref row).

        With `edit`, the fork's head is instead a copy of that step with the
        given content fields replaced (a tool's `result`, a model call's
        `response` or `messages`, ...): an edited step under the original's
        parent, with `meta.edit_of` naming the original. Nothing is copied
        but that one step, and the original run is untouched.
        """
        from kvtrace.store.run import Run

        new_name = validate_run_name(new_name)
        if edit is not None:
            return Run(self, new_name, self._fork_edited(spec, new_name, edit))
        with self._write() as conn:
            step_id = resolve.step_id(conn, spec)
            message = f"fork from {spec} ({step_id[:12]})"
            create_ref(conn, new_name, step_id, reason="fork", message=message)
            head = history.load_steps(conn, [step_id], self._lists_cache())[0]
        return Run(self, new_name, head)

    def _fork_edited(self, spec: str, new_name: str, edit: Mapping[str, Any]) -> Step:
        from kvtrace.store.edits import editable_fields, edited_content

        if not isinstance(edit, Mapping) or not edit:
            raise UsageError("edit must map content fields to their new values")
        with read_transaction(self._reader) as conn:
            found = resolve.step_id(conn, spec)
            original = history.load_steps(conn, [found], self._lists_cache())[0]
            kept = conn.execute(sa.select(steps.c.body, steps.c.body_codec)
                                .where(steps.c.id == original.id)).one()
            body = json.loads(bodies.decode(kept.body, kept.body_codec))
            parent = (history.load_steps(conn, [original.parent_id], self._lists_cache())[0]
                      if original.parent_id else None)
        unknown = sorted(set(edit) - editable_fields(original))
        if unknown:
            raise UsageError(f"step {original.short_id} has no field {unknown[0]!r} to edit "
                             f"(its fields: {', '.join(sorted(original.content))})")
        content = edited_content(original, edit)
        list_fields = set(store_lists.lists_of(body)) | (
            {ModelCall(original).conversation_field}
            if original.kind == StepKind.MODEL_CALL else set())
        raw_fields = set(body["raw"])
        # Measurements of the original call (usage, timings) do not describe the copy.
        meta = {k: v for k, v in original.meta.items() if k not in MEASUREMENTS}
        meta[EDIT_OF] = original.id
        return self.append(
            new_name, parent, original.kind,
            {k: v for k, v in content.items() if k not in list_fields | raw_fields},
            meta,
            raw={k: v for k, v in content.items() if k in raw_fields},
            lists={k: v for k, v in content.items() if k in list_fields},
            new_run=f"fork from {spec} ({original.id[:12]}), edited: {', '.join(sorted(edit))}",
        )

    @retried
    def revert(self, name: str, *, to: str) -> Step:
        """Move run `name` back to `to`, an ancestor of its head.

        The reverted steps stay in the store and in the reflog; `reset` to the
        old head (or `undo`) brings them back.
        """
        name = normalize_run_name(name)
        with self._write() as conn:
            head_id = resolve.head_id(conn, name)
            target = resolve.step_id(conn, to)
            if (
                head_id is None
                or target == head_id
                or not history.is_ancestor(conn, target, head_id)
            ):
                raise UsageError(
                    f"cannot revert {name!r} to {to!r}: it is not an earlier step of that run "
                    "(use reset to move a run to any step)"
                )
            message = f"revert to {to} ({target[:12]})"
            move_ref(conn, name, head_id, target, reason="revert", message=message)
            return history.load_steps(conn, [target], self._lists_cache())[0]

    @retried
    def reset(self, name: str, *, to: str | None = None) -> Step:
        """Move run `name` to any step `to` (e.g. a reverted head, to undo a revert).

        Without `to`, the run goes to the head its reflog last recorded: this
        repairs a ref moved behind kvtrace's back and restores a deleted one
        (fsck reports both).
        """
        name = normalize_run_name(name)
        with self._write() as conn:
            row = resolve.ref_row(conn, name)
            last = last_logged(conn, name)
            if row is None and last is None:
                resolve.head_id(conn, name)  # raises RunNotFoundError
            if to is None:
                if last is None or last[1] is None:
                    raise UsageError(f"run {name!r} has no reflog head to reset to: pass to=STEP",
                                     param="to")
                target, message = last[1], f"reset to its last reflog head ({last[1][:12]})"
            else:
                target = resolve.step_id(conn, to)
                message = f"reset to {to} ({target[:12]})"
            if row is None:  # deleted behind kvtrace's back: recreate it from the reflog
                create_ref(conn, name, target, reason="reset", message=f"restore: {message}")
            else:
                move_ref(conn, name, row.head, target, reason="reset", message=message)
            return history.load_steps(conn, [target], self._lists_cache())[0]

    @retried
    def undo(self, name: str) -> Step | None:
        """Undo the last move of run `name` (itself recorded as a reset)."""
        name = normalize_run_name(name)
        with self._write() as conn:
            head_id = resolve.head_id(conn, name)
            last = conn.execute(
                sa.select(reflog)
                .where(reflog.c.ref == name, reflog.c.reason.not_in(PAUSE_REASONS))
                .order_by(reflog.c.id.desc())
                .limit(1)
            ).first()
            if last is None or last.reason in ("create", "fork", "import"):
                raise UsageError(f"run {name!r} has no move to undo")
            target = last.old_head
            move_ref(conn, name, head_id, target, reason="reset", message=f"undo {last.reason}")
            return history.load_steps(conn, [target], self._lists_cache())[0] if target else None

    def reflog(self, name: str | None = None, *, limit: int | None = None) -> list[ReflogEntry]:
        """Every move of run `name`, newest first; without a name, of every run ever,
        including runs whose ref was deleted behind kvtrace's back. With `limit`, the
        newest `limit` moves (`limit=1`: the last move, one index probe)."""
        limit = validation.check_limit(limit)
        query = sa.select(reflog).order_by(reflog.c.id.desc()).limit(limit)
        with read_transaction(self._reader) as conn:
            if name is not None:
                name = normalize_run_name(name)
                if last_logged(conn, name) is None:
                    resolve.head_id(conn, name)  # raises RunNotFoundError
                query = query.where(reflog.c.ref == name)
            rows = conn.execute(query).all()
        return [
            ReflogEntry(r.id, r.ref, r.old_head, r.new_head, r.reason, r.message, r.created_at)
            for r in rows
        ]

    # -- supervision -------------------------------------------------------------

    def pause(self, name: str, *, reason: str = "paused by a supervisor") -> None:
        """Pause run `name`: until `resume`, appends to it raise RunPausedError."""
        self._set_paused(name, True, reason)

    def resume(self, name: str, *, reason: str = "resumed") -> None:
        """Let appends to run `name` go on again."""
        self._set_paused(name, False, reason)

    def is_paused(self, name: str) -> bool:
        """Whether run `name` is paused."""
        with read_transaction(self._reader) as conn:
            resolve.head_id(conn, name)
            return pause_entry(conn, name) is not None

    @retried
    def _set_paused(self, name: str, paused: bool, reason: str) -> None:
        if not isinstance(reason, str) or not reason.strip():
            raise UsageError("a pause or resume needs a reason (some text)")
        name = normalize_run_name(name)
        with self._write() as conn:
            resolve.head_id(conn, name)  # an unknown run is an error
            set_paused(conn, name, paused=paused, message=reason)

    def watch(
        self,
        name: str,
        *,
        since: int | None = None,
        timeout: float | None = None,
        poll_interval: float = 0.1,
    ) -> Iterator[WatchEvent]:
        """Yield what happens to run `name` as it happens, from any process (see watch.py)."""
        from kvtrace.store.watch import watch

        name = normalize_run_name(name)
        # "From now on" means from this call, not the first next(); an unknown run fails
        # here, not on first iteration.
        start = self.watch_cursor(name)
        since = start if since is None else since
        def load_steps(conn: Any, ids: list[str]) -> list[Step]:
            return history.load_steps(conn, ids, self._lists_cache())

        return watch(self.engine, name, load_steps=load_steps, since=since, timeout=timeout,
                     poll_interval=poll_interval)

    def watch_cursor(self, name: str) -> int:
        """The cursor of the latest event of run `name` (0 before any): what happens after
        this call is what `watch(name, since=cursor)` yields.

        For a caller that watches in separate calls (an MCP client polling, say):
        it keeps the cursor between them, so no event falls between two calls.
        One indexed row, however long the run.
        """
        name = normalize_run_name(name)
        with read_transaction(self._reader) as conn:
            resolve.head_id(conn, name)  # an unknown run is an error
            last = last_logged(conn, name)
        return last[0] if last is not None else 0

    # -- notes -----------------------------------------------------------------

    @retried
    def note(self, spec: str, text: str, author: str | None = None) -> Note:
        """Attach a note to a step; the step itself never changes."""
        validation.check_note(text, author)
        with self._write() as conn:
            return step_notes.add(conn, resolve.step_id(conn, spec), text, author)

    def notes(self, spec: str) -> list[Note]:
        """Notes on the step `spec`, oldest first."""
        with read_transaction(self._reader) as conn:
            return step_notes.of_step(conn, resolve.step_id(conn, spec))

    def notes_on(self, step_ids: list[str]) -> dict[str, list[Note]]:
        """Notes on each of the steps `step_ids` (full ids), oldest first (notes.py). A step
        without notes is absent."""
        with read_transaction(self._reader) as conn:
            return step_notes.on_steps(conn, step_ids)

    # -- integrity and exchange ------------------------------------------------

    def fsck(self) -> FsckReport:
        """Re-hash every blob and step and check every reference; see fsck.py."""
        from kvtrace.store.objects.fsck import check

        with read_transaction(self._reader) as conn:
            return check(conn)

    def export_run(self, name: str, file: IO[bytes]) -> int:
        """Write run `name` with all its steps, blobs and notes as a bundle."""
        from kvtrace.store.bundle import write_bundle

        with read_transaction(self._reader) as conn:
            head_id = resolve.head_id(conn, name)
            chain = list(reversed(history.chain(conn, head_id, None))) if head_id else []
            return write_bundle(conn, file, name, head_id, chain)

    def import_bundle(self, file: IO[bytes], *, name: str | None = None) -> RunInfo:
        """Import a bundle (verifying every hash) as run `name` (default: its own)."""
        return self._import(file.read(), name)

    @retried
    def _import(self, data: bytes, name: str | None) -> RunInfo:
        from kvtrace.store.bundle import read_bundle

        with self._write() as conn:
            return read_bundle(conn, io.BytesIO(data), name)
