"""The trace store: content-addressed steps and blobs, runs as refs, a reflog.

`Store` composes three layers, each with one job: blobs and steps (immutable,
addressed by SHA-256, see encoding.py), refs (moved only by compare-and-swap in
refs.py, which also appends the reflog) and notes. Every public method is one
transaction, so a failure leaves nothing half-written.

Cost model: appending, forking and moving a ref touch a constant number of
rows; walking history (log, RUN@N, ancestry checks) is one recursive query
bounded by the distance walked, never by the size of the store.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from kvtrace.errors import (
    IntegrityError,
    RunNotFoundError,
    StepNotFoundError,
    UsageError,
)
from kvtrace.store import encoding
from kvtrace.store.backend import insert_ignore, read_transaction, write_transaction, writer
from kvtrace.store.names import Spec, parse_spec, validate_run_name
from kvtrace.store.records import Divergence, FsckReport, Note, ReflogEntry, RunInfo, Step
from kvtrace.store.refs import create_ref, move_ref
from kvtrace.store.schema import blobs, notes, reflog, refs, steps

if TYPE_CHECKING:
    from kvtrace.store.run import Run

_MAX_KIND = 64
_IN_CHUNK = 500


class Store:
    """A trace store on one database (SQLite file or PostgreSQL)."""

    def __init__(self, engine: Engine, url: str) -> None:
        self._engine = engine
        self._writer = writer(engine)
        self.url = url

    # -- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Release database connections."""
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for tools such as benchmarks and tests)."""
        return self._engine

    # -- runs ------------------------------------------------------------------

    def run(self, name: str) -> Run:
        """The run `name`, created empty if it does not exist yet."""
        from kvtrace.store.run import Run

        validate_run_name(name)
        with write_transaction(self._writer) as conn:
            row = conn.execute(sa.select(refs.c.head).where(refs.c.name == name)).first()
            if row is None:
                create_ref(conn, name, None, reason="create", message="new run")
                head = None
            else:
                head = self._load_steps(conn, [row.head])[0] if row.head else None
        return Run(self, name, head)

    def runs(self) -> list[RunInfo]:
        """Every run, by name."""
        with read_transaction(self._engine) as conn:
            rows = conn.execute(
                sa.select(refs.c.name, refs.c.head, refs.c.created_at, steps.c.depth)
                .select_from(refs.outerjoin(steps, steps.c.id == refs.c.head))
                .order_by(refs.c.name)
            ).all()
        return [RunInfo(r.name, r.head, r.depth or 0, r.created_at) for r in rows]

    def head(self, name: str) -> Step | None:
        """The head step of run `name` (None for an empty run)."""
        with read_transaction(self._engine) as conn:
            head_id = self._head_id(conn, name)
            return self._load_steps(conn, [head_id])[0] if head_id else None

    # -- reading ---------------------------------------------------------------

    def resolve(self, spec: str) -> str:
        """The full id of the step that `spec` addresses."""
        with read_transaction(self._engine) as conn:
            return self._resolve(conn, spec)

    def show(self, spec: str) -> Step:
        """The step that `spec` addresses, with its content."""
        with read_transaction(self._engine) as conn:
            return self._load_steps(conn, [self._resolve(conn, spec)])[0]

    def log(self, spec: str, *, limit: int | None = None) -> Iterator[Step]:
        """Steps from `spec` (a run means its head) back to the root, head first."""
        with read_transaction(self._engine) as conn:
            start = self._resolve_or_empty(conn, spec)
            chain = self._chain(conn, start, limit) if start else []
            loaded = self._load_steps(conn, chain)
        yield from loaded

    def path(self, spec: str) -> list[Step]:
        """Steps from the root to `spec`, in order (what replay walks)."""
        return list(reversed(list(self.log(spec))))

    def diverge(self, a: str, b: str) -> Divergence:
        """Where the histories of `a` and `b` part (like `git merge-base`)."""
        with read_transaction(self._engine) as conn:
            chains = []
            for spec in (a, b):
                start = self._resolve_or_empty(conn, spec)
                chains.append(list(reversed(self._chain(conn, start, None))) if start else [])
            chain_a, chain_b = chains
            shared = 0
            while shared < min(len(chain_a), len(chain_b)) and chain_a[shared] == chain_b[shared]:
                shared += 1
            wanted = [chain_a[shared - 1]] if shared else []
            wanted += chain_a[shared : shared + 1] + chain_b[shared : shared + 1]
            loaded = {step.id: step for step in self._load_steps(conn, wanted)}
        return Divergence(
            common=loaded[chain_a[shared - 1]] if shared else None,
            first_a=loaded.get(chain_a[shared]) if shared < len(chain_a) else None,
            first_b=loaded.get(chain_b[shared]) if shared < len(chain_b) else None,
            num_only_a=len(chain_a) - shared,
            num_only_b=len(chain_b) - shared,
        )

    def read_blob(self, address: str) -> bytes:
        """The bytes stored at `address`."""
        with read_transaction(self._engine) as conn:
            data = conn.execute(sa.select(blobs.c.data).where(blobs.c.hash == address)).scalar()
        if data is None:
            raise StepNotFoundError(f"no blob {address[:12]} in the store")
        return bytes(data)

    def children(self, spec: str) -> list[Step]:
        """Steps whose parent is `spec` (where runs fork apart)."""
        with read_transaction(self._engine) as conn:
            parent = self._resolve(conn, spec)
            ids = conn.execute(sa.select(steps.c.id).where(steps.c.parent_id == parent)).scalars()
            return self._load_steps(conn, list(ids))

    # -- moving refs -----------------------------------------------------------

    def fork(self, spec: str, new_name: str) -> Run:
        """A new run `new_name` whose head is the step `spec` (O(1): one ref row)."""
        from kvtrace.store.run import Run

        validate_run_name(new_name)
        with write_transaction(self._writer) as conn:
            step_id = self._resolve(conn, spec)
            create_ref(conn, new_name, step_id, reason="fork", message=f"fork from {spec}")
            head = self._load_steps(conn, [step_id])[0]
        return Run(self, new_name, head)

    def revert(self, name: str, *, to: str) -> Step:
        """Move run `name` back to `to`, an ancestor of its head.

        The reverted steps stay in the store and in the reflog; `reset` to the
        old head (or `undo`) brings them back.
        """
        with write_transaction(self._writer) as conn:
            head_id = self._head_id(conn, name)
            target = self._resolve(conn, to)
            if head_id is None or target == head_id or not self._is_ancestor(conn, target, head_id):
                raise UsageError(
                    f"cannot revert {name!r} to {to!r}: it is not an earlier step of that run "
                    "(use reset to move a run to any step)"
                )
            move_ref(conn, name, head_id, target, reason="revert", message=f"revert to {to}")
            return self._load_steps(conn, [target])[0]

    def reset(self, name: str, *, to: str) -> Step:
        """Move run `name` to any step `to` (e.g. a reverted head, to undo a revert)."""
        with write_transaction(self._writer) as conn:
            head_id = self._head_id(conn, name)
            target = self._resolve(conn, to)
            move_ref(conn, name, head_id, target, reason="reset", message=f"reset to {to}")
            return self._load_steps(conn, [target])[0]

    def undo(self, name: str) -> Step | None:
        """Undo the last move of run `name` (itself recorded as a reset)."""
        with write_transaction(self._writer) as conn:
            head_id = self._head_id(conn, name)
            last = conn.execute(
                sa.select(reflog).where(reflog.c.ref == name).order_by(reflog.c.id.desc()).limit(1)
            ).first()
            if last is None or last.reason in ("create", "fork", "import"):
                raise UsageError(f"run {name!r} has no move to undo")
            target = last.old_head
            move_ref(conn, name, head_id, target, reason="reset", message=f"undo {last.reason}")
            return self._load_steps(conn, [target])[0] if target else None

    def reflog(self, name: str) -> list[ReflogEntry]:
        """Every move of run `name`, newest first."""
        with read_transaction(self._engine) as conn:
            self._head_id(conn, name)
            rows = conn.execute(
                sa.select(reflog).where(reflog.c.ref == name).order_by(reflog.c.id.desc())
            ).all()
        return [
            ReflogEntry(r.id, r.ref, r.old_head, r.new_head, r.reason, r.message, r.created_at)
            for r in rows
        ]

    # -- notes -----------------------------------------------------------------

    def note(self, spec: str, text: str, author: str | None = None) -> Note:
        """Attach a note to a step; the step itself never changes."""
        if not text.strip():
            raise UsageError("a note needs some text")
        with write_transaction(self._writer) as conn:
            step_id = self._resolve(conn, spec)
            now = time.time()
            result = conn.execute(
                sa.insert(notes).values(step_id=step_id, author=author, text=text, created_at=now)
            )
            (note_id,) = result.inserted_primary_key or (0,)
        return Note(int(note_id), step_id, text, author, now)

    def notes(self, spec: str) -> list[Note]:
        """Notes on the step `spec`, oldest first."""
        with read_transaction(self._engine) as conn:
            step_id = self._resolve(conn, spec)
            rows = conn.execute(
                sa.select(notes).where(notes.c.step_id == step_id).order_by(notes.c.id)
            ).all()
        return [Note(r.id, r.step_id, r.text, r.author, r.created_at) for r in rows]

    # -- integrity and exchange ------------------------------------------------

    def fsck(self) -> FsckReport:
        """Re-hash every blob and step and check every reference; see fsck.py."""
        from kvtrace.store.fsck import check

        with read_transaction(self._engine) as conn:
            return check(conn)

    def export_run(self, name: str, file: IO[bytes]) -> int:
        """Write run `name` with all its steps, blobs and notes as a bundle."""
        from kvtrace.store.bundle import write_bundle

        with read_transaction(self._engine) as conn:
            head_id = self._head_id(conn, name)
            chain = list(reversed(self._chain(conn, head_id, None))) if head_id else []
            return write_bundle(conn, file, name, head_id, chain)

    def import_bundle(self, file: IO[bytes], *, name: str | None = None) -> RunInfo:
        """Import a bundle (verifying every hash) as run `name` (default: its own)."""
        from kvtrace.store.bundle import read_bundle

        with write_transaction(self._writer) as conn:
            return read_bundle(conn, file, name)

    # -- appending (used by Run) -----------------------------------------------

    def append(
        self,
        name: str,
        parent: Step | None,
        kind: str,
        payload: Mapping[str, Any],
        meta: Mapping[str, Any],
        raw: Mapping[str, bytes] | None = None,
    ) -> Step:
        """Record a step after `parent` and move run `name` onto it, atomically.

        Fails with ConflictError, writing nothing, if the run's head is no
        longer `parent` (another writer appended or moved it first).
        """
        if not kind or len(kind) > _MAX_KIND or not kind.replace("_", "").isalnum():
            raise UsageError(f"bad step kind {kind!r}: use letters, digits and '_'")
        raw = raw or {}
        clash = set(payload) & set(raw)
        if clash:
            raise UsageError(f"payload fields given twice: {sorted(clash)}")
        data = {key: encoding.canonical_json(value) for key, value in payload.items()}
        data.update(raw)
        addresses = {key: encoding.sha256_hex(value) for key, value in data.items()}
        clean_meta = {key: value for key, value in meta.items() if value is not None}
        parent_id = parent.id if parent else None
        body = encoding.step_body(
            kind=kind, parent=parent_id, payload=addresses, raw=list(raw), meta=clean_meta
        )
        step_id = encoding.sha256_hex(body)
        depth = parent.depth + 1 if parent else 1
        now = time.time()
        with write_transaction(self._writer) as conn:
            insert_ignore(
                conn,
                blobs,
                [
                    {"hash": addresses[key], "size": len(value), "data": value}
                    for key, value in data.items()
                ],
                "hash",
            )
            insert_ignore(
                conn,
                steps,
                [
                    {
                        "id": step_id,
                        "parent_id": parent_id,
                        "kind": kind,
                        "depth": depth,
                        "body": body,
                        "recorded_at": now,
                    }
                ],
                "id",
            )
            move_ref(conn, name, parent_id, step_id, reason="append", message=kind)
        content = {**dict(payload), **dict(raw)}
        return Step(step_id, parent_id, kind, depth, addresses, clean_meta, content, now)

    # -- internals -------------------------------------------------------------

    def _head_id(self, conn: Connection, name: str) -> str | None:
        row = conn.execute(sa.select(refs.c.head).where(refs.c.name == name)).first()
        if row is None:
            raise RunNotFoundError(f"no run named {name!r} (see `kvtrace runs`)")
        return row.head

    def _resolve_or_empty(self, conn: Connection, spec: str) -> str | None:
        parsed = parse_spec(spec)
        if parsed.run is not None and parsed.number is None and parsed.back == 0:
            row = conn.execute(sa.select(refs.c.head).where(refs.c.name == parsed.run)).first()
            if row is not None:
                return row.head
        return self._resolve(conn, spec)

    def _resolve(self, conn: Connection, text: str) -> str:
        spec = parse_spec(text)
        if spec.run is not None:
            row = conn.execute(sa.select(refs.c.head).where(refs.c.name == spec.run)).first()
            if row is not None:
                return self._position(conn, text, spec, row.head)
            if spec.prefix is None:
                raise RunNotFoundError(f"no run named {spec.run!r} (see `kvtrace runs`)")
        return self._by_prefix(conn, spec.prefix or "")

    def _position(self, conn: Connection, text: str, spec: Spec, head_id: str | None) -> str:
        if head_id is None:
            raise StepNotFoundError(f"run {spec.run!r} has no steps yet")
        depth = conn.execute(sa.select(steps.c.depth).where(steps.c.id == head_id)).scalar_one()
        back = spec.back if spec.number is None else depth - spec.number
        if back < 0 or back >= depth:
            raise StepNotFoundError(
                f"{text!r} is outside run {spec.run!r}, which has {depth} steps"
            )
        return head_id if back == 0 else self._chain(conn, head_id, back + 1)[-1]

    def _by_prefix(self, conn: Connection, prefix: str) -> str:
        ids = (
            conn.execute(
                sa.select(steps.c.id).where(steps.c.id.startswith(prefix, autoescape=True)).limit(2)
            )
            .scalars()
            .all()
        )
        if not ids:
            raise StepNotFoundError(f"no step or run matches {prefix!r}")
        if len(ids) > 1:
            raise StepNotFoundError(f"step-id prefix {prefix!r} is ambiguous: give more characters")
        return str(ids[0])

    def _chain(self, conn: Connection, start: str, limit: int | None) -> list[str]:
        """Ids from `start` back towards the root, at most `limit` of them."""
        chain = (
            sa.select(steps.c.id, steps.c.parent_id, sa.literal(1).label("n"))
            .where(steps.c.id == start)
            .cte("chain", recursive=True)
        )
        step = sa.select(steps.c.id, steps.c.parent_id, (chain.c.n + 1).label("n")).join(
            chain, steps.c.id == chain.c.parent_id
        )
        if limit is not None:
            step = step.where(chain.c.n < limit)
        chain = chain.union_all(step)
        rows = conn.execute(sa.select(chain.c.id).order_by(chain.c.n)).scalars().all()
        return [str(r) for r in rows]

    def _is_ancestor(self, conn: Connection, ancestor: str, descendant: str) -> bool:
        depths = dict(
            conn.execute(
                sa.select(steps.c.id, steps.c.depth).where(steps.c.id.in_([ancestor, descendant]))
            ).all()
        )
        distance = depths[descendant] - depths[ancestor]
        if distance <= 0:
            return False
        return self._chain(conn, descendant, distance + 1)[-1] == ancestor

    def _load_steps(self, conn: Connection, ids: list[str]) -> list[Step]:
        """Steps with their content, in the order of `ids`."""
        rows: dict[str, Any] = {}
        for chunk in _chunks(ids):
            for row in conn.execute(sa.select(steps).where(steps.c.id.in_(chunk))):
                rows[row.id] = row
        missing = [i for i in ids if i not in rows]
        if missing:
            raise StepNotFoundError(f"step {missing[0][:12]} is missing from the store")
        bodies = {i: json.loads(bytes(rows[i].body)) for i in ids}
        wanted = {addr for body in bodies.values() for addr in body["payload"].values()}
        data: dict[str, bytes] = {}
        for chunk in _chunks(sorted(wanted)):
            for address, blob in conn.execute(
                sa.select(blobs.c.hash, blobs.c.data).where(blobs.c.hash.in_(chunk))
            ):
                data[address] = bytes(blob)
        result = []
        for i in ids:
            body, row = bodies[i], rows[i]
            content: dict[str, Any] = {}
            for key, address in body["payload"].items():
                if address not in data:
                    raise IntegrityError(f"step {i[:12]} refers to missing blob {address[:12]}")
                blob = data[address]
                content[key] = blob if key in body["raw"] else json.loads(blob)
            result.append(
                Step(
                    i,
                    row.parent_id,
                    row.kind,
                    row.depth,
                    body["payload"],
                    body["meta"],
                    content,
                    row.recorded_at,
                )
            )
        return result


def _chunks(items: list[str]) -> Iterable[list[str]]:
    for start in range(0, len(items), _IN_CHUNK):
        yield items[start : start + _IN_CHUNK]
