"""fsck: re-hash everything and check every reference, in bounded memory.

Checks: each step's body is canonical, well formed, hashes to its id and
agrees with its columns (parent, kind, depth, skip pointer); each parent and
payload blob exists; each list builds on an ancestor that has the list, in a
chain short enough; each blob hashes to its address and has its recorded
size, and a blob some step reads as JSON is canonical JSON; refs, the reflog
and notes as fsck_refs.py says. It never writes.

Memory does not grow with the store. Steps and blobs are streamed in pages of
`_PAGE` rows; what a page's steps refer to (parents, skip pointers' targets,
lists' bases, blobs) is found in bounded caches of recent steps, lists and
blobs (recent.py, `lists.ListCache`), and what they miss is read by primary
key, one query per page and kind. The store is written in order, so a step's
history is nearly always recent and the cache of steps answers almost every
lookup; a blob is looked up by its address when a step first names it. A
skip pointer is checked against the walk along its ancestors' stored
pointers: if any pointer is wrong, the shallowest wrong one is found by a
walk over right ones, so a store is reported sound only when every pointer
is right, and a hop that does not go shallower ends a walk.

Only the steps say which blobs are read as JSON, so the blob pass (first)
parses every blob and remembers those that are not canonical JSON: raw bytes
(a streamed HTTP body), or a broken JSON blob. A step reading one as JSON is
then a problem. A store with more than `_MAX_NOT_JSON` of them is checked
the slower way, in the same memory: each blob a step reads as JSON is read
again and parsed when the step is checked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from kvtrace.errors import IntegrityError, UsageError
from kvtrace.store.db.schema import blobs, steps
from kvtrace.store.objects import bodies, codec, lists, trees
from kvtrace.store.objects.encoding import decode_body, decode_json_blob
from kvtrace.store.objects.fsck_refs import check_notes, check_refs, check_time
from kvtrace.store.objects.history import ancestor_in_memory, chunks, skip_in_memory
from kvtrace.store.recent import Recent
from kvtrace.store.records import FsckReport

_PAGE = 1000  # rows streamed and checked together
_RECENT_STEPS = 50_000  # steps' links kept per generation (~10 MB)
_RECENT_BLOBS = 50_000  # addresses known to exist, per generation (~8 MB)
_MAX_LISTS = 20_000  # resolved lists kept, and the item addresses they may hold
_MAX_LIST_ITEMS = 200_000
_MAX_NOT_JSON = 50_000  # blobs not canonical JSON remembered by the blob pass (~10 MB)

Link = tuple[str | None, int, str | None]  # a step's (parent, depth, skip_id)
Lookup = Callable[[str], Link]
T = TypeVar("T")


def check(conn: Connection) -> FsckReport:
    """Return a report whose `problems` list is empty on a sound store."""
    problems: list[str] = []
    num_blobs, not_json = _check_blobs(conn, problems)
    num_steps = _StepPass(conn, problems, not_json).run()
    num_refs = check_refs(conn, problems)
    num_notes = check_notes(conn, problems)
    return FsckReport(num_blobs, num_steps, num_refs, num_notes, problems)


def _check_blobs(conn: Connection, problems: list[str]) -> tuple[int, dict[str, str] | None]:
    """Re-hash every blob and parse each as canonical JSON. Return how many there are,
    and why each that is not canonical JSON is not (address -> problem), to be reported if a
    step reads it as JSON; None when there are more than `_MAX_NOT_JSON` of them."""
    num_blobs = 0
    not_json: dict[str, str] | None = {}
    query = sa.select(blobs.c.hash, blobs.c.size, blobs.c.codec, blobs.c.data)
    page: dict[str, codec.Kept] = {}
    for address, size, kept_as, data in conn.execution_options(yield_per=_PAGE).execute(query):
        num_blobs += 1
        page[address] = codec.Kept(size, kept_as, bytes(data))
        if len(page) >= _PAGE:
            not_json = _check_blob_page(conn, page, problems, not_json)
            page = {}
    not_json = _check_blob_page(conn, page, problems, not_json)
    return num_blobs, not_json


def _check_blob_page(conn: Connection, page: dict[str, codec.Kept], problems: list[str],
                     not_json: dict[str, str] | None) -> dict[str, str] | None:
    """Decode and re-hash a page of blobs (the bases of its deltas read as needed)."""
    for address, content in codec.decode_rows(conn, page).items():
        if isinstance(content, IntegrityError):
            problems.append(f"blob {address[:12]}: {content}")
            continue
        problem = _blob_problem(address, page[address].size, content)
        if problem:
            problems.append(problem)
        elif not_json is not None:
            try:
                decode_json_blob(content)
            except (IntegrityError, UsageError) as exc:  # UsageError: nested past the limit
                not_json[address] = f"blob {address[:12]}: {exc}"
                if len(not_json) > _MAX_NOT_JSON:
                    not_json = None
    return not_json


class _StepPass:
    """Every step, a page at a time, with what it refers to."""

    def __init__(self, conn: Connection, problems: list[str],
                 not_json: dict[str, str] | None) -> None:
        self._conn = conn
        self._problems = problems
        self._not_json = not_json
        self._links: Recent[str, Link] = Recent(_RECENT_STEPS)
        self._lists = lists.ListCache(max_entries=_MAX_LISTS, max_items=_MAX_LIST_ITEMS)
        self._blobs: Recent[str, bool] = Recent(_RECENT_BLOBS)  # -> checked as JSON yet
        self._bad_json: set[str] = set()  # reported once, however many steps read them

    def run(self) -> int:
        """Check every step; return how many there are."""
        num_steps = 0
        result = self._conn.execution_options(yield_per=_PAGE).execute(sa.select(steps))
        for page in result.partitions():
            num_steps += len(page)
            self._check_page(page)
        return num_steps

    def _check_page(self, page: Sequence[Row[Any]]) -> None:
        values: dict[str, dict[str, Any]] = {}
        for row in page:
            self._links[row.id] = (row.parent_id, row.depth, row.skip_id)
            check_time(f"step {row.id[:12]}: recorded_at", row.recorded_at, self._problems)
            value = _check_body(row, self._problems)
            if value is not None:
                values[row.id] = value
        entries = {step_id: lists.lists_of(value) for step_id, value in values.items()}
        bases = {entry["base"] for found in entries.values() for entry in found.values()}
        self._read_links({row.parent_id for row in page} | {row.skip_id for row in page} | bases)
        for row in page:
            self._problems.extend(self._history_problems(row))
        rows = {row.id: row for row in page}
        for step_id, found in entries.items():
            self._check_bases(rows[step_id], found)
        self._check_chains(entries)
        self._check_blob_refs(values, entries)
        self._check_workspaces(values)

    # -- history -------------------------------------------------------------------

    def _history_problems(self, row: Row[Any]) -> list[str]:
        """Its parent exists, its depth counts from the root, its skip pointer points where
        it must (walking its ancestors' pointers)."""
        label = f"step {row.id[:12]}"
        problems = []
        if row.parent_id is None:
            if row.depth != 1:
                problems.append(f"{label}: root step has depth {row.depth}, not 1")
        else:
            parent = self._find(row.parent_id)
            if parent is None:
                return [f"{label}: parent {row.parent_id[:12]} is missing"]
            if row.depth != parent[1] + 1:
                return [f"{label}: depth {row.depth} is not its parent's depth + 1"]
        try:
            want = self._walk(partial(skip_in_memory, row.parent_id, row.depth))
        except (KeyError, IntegrityError):
            return problems  # an ancestor's problem, reported at that ancestor
        if want != (row.skip_id, row.skip_depth):
            problems.append(f"{label}: skip pointer is wrong")
        return problems

    def _find(self, step_id: str) -> Link | None:
        """(parent, depth, skip_id) of a step, or None when it is not in the store."""
        try:
            return self._links[step_id]
        except KeyError:
            self._read_links({step_id})
            return self._links.get(step_id)

    def _walk(self, walk: Callable[[Lookup], T]) -> T:
        """`walk(lookup)` along the links kept, reading each link it misses (then walking
        again); KeyError when a step it reaches is not in the store."""
        while True:
            try:
                return walk(self._links.lookup())
            except KeyError as exc:
                if not self._links.revive(exc.args[0]) and not self._read_links({exc.args[0]}):
                    raise

    def _read_links(self, ids: set[Any]) -> bool:
        """Keep the links of the steps `ids` not kept yet; whether any was read."""
        ids.discard(None)
        wanted = sorted(self._links.missing(ids))
        query = sa.select(steps.c.id, steps.c.parent_id, steps.c.depth, steps.c.skip_id)
        is_read = False
        for part in chunks(wanted):
            for step_id, parent, depth, skip_id in self._conn.execute(
                    query.where(steps.c.id.in_(part))):
                self._links[step_id] = (parent, depth, skip_id)
                is_read = True
        return is_read

    # -- lists ---------------------------------------------------------------------

    def _check_bases(self, row: Row[Any], entries: dict[str, Any]) -> None:
        """Every list builds on a strict ancestor."""
        for field, entry in entries.items():
            base = entry["base"]
            if base is None:
                continue
            found = self._find(base)
            base_depth = None if found is None else found[1]
            try:
                is_ancestor = base_depth is not None and row.parent_id is not None and (
                    base_depth < row.depth) and self._walk(partial(
                        ancestor_in_memory, row.parent_id, base_depth)) == base
            except (KeyError, IntegrityError):  # a broken history, reported where it breaks
                continue
            if not is_ancestor:
                self._problems.append(f"step {row.id[:12]}: list {field!r} builds on "
                                      f"{base[:12]}, which is not one of its ancestors")

    def _check_chains(self, entries: dict[str, dict[str, Any]]) -> None:
        """Every list's chain of bases has the list all along and is short enough."""
        keys = [(step_id, field) for step_id, found in entries.items() for field in found]
        fetch = self._fetch_lists(entries)
        try:
            lists.resolve(fetch, keys, self._lists)
        except IntegrityError:  # which of them: one at a time
            for step_id, field in keys:
                try:
                    lists.resolve(fetch, [(step_id, field)], self._lists)
                except IntegrityError as exc:
                    self._problems.append(f"step {step_id[:12]}: list {field!r}: {exc}")
        self._lists.make_room()

    def _fetch_lists(self, page: dict[str, dict[str, Any]]) -> lists.FetchLists:
        """The lists of the page's steps, and of earlier steps read again: only sound bodies
        count (any other is reported where it is)."""

        def fetch(ids: list[str]) -> dict[str, dict[str, Any]]:
            found = {i: page[i] for i in ids if i in page}
            query = sa.select(steps.c.id, steps.c.parent_id, steps.c.kind, steps.c.body,
                              steps.c.body_codec)
            for part in chunks([i for i in ids if i not in page]):
                for row in self._conn.execute(query.where(steps.c.id.in_(part))):
                    value = _check_body(row, [])
                    if value is not None:
                        found[row.id] = lists.lists_of(value)
            return found

        return fetch

    # -- blobs ---------------------------------------------------------------------

    def _check_blob_refs(self, values: dict[str, dict[str, Any]],
                         entries: dict[str, dict[str, Any]]) -> None:
        """Every blob a step names exists, and one it reads as JSON is canonical JSON."""
        as_json: set[str] = set()
        as_raw: set[str] = set()
        for value in values.values():
            raw = value["raw"]
            for key, address in value["payload"].items():
                (as_raw if key in raw else as_json).add(address)
        for found in entries.values():
            for entry in found.values():
                as_json.update(entry["items"])
        if self._not_json is None:  # too many blobs are not JSON: read those read as JSON
            to_check = sorted(a for a in as_json if self._blobs.get(a) is not True)
            to_find = sorted(a for a in as_raw - as_json if self._blobs.get(a) is None)
        else:
            for address in sorted(a for a in as_json if a in self._not_json):
                self._report_json(address, self._not_json[address])
            to_check = []
            to_find = sorted(self._blobs.missing(as_json.union(as_raw)))
        missing = set(to_check).union(to_find)
        missing.difference_update(self._check_json(to_check))
        query = sa.select(blobs.c.hash)
        for part in chunks(to_find):
            present = self._conn.execute(query.where(blobs.c.hash.in_(part))).scalars().all()
            self._blobs.set_all(present, self._not_json is not None)  # then JSON is known
            missing.difference_update(present)
        if missing:
            self._report_missing(values, entries, missing)

    def _check_workspaces(self, values: dict[str, dict[str, Any]]) -> None:
        """A workspace tree a step names, and the files it names, are in the store."""
        named = {step_id: tree for step_id, value in values.items()
                 if (tree := trees.tree_of_body(value)) is not None}
        if not named:
            return
        try:
            files = trees.reached(self._conn, named.values())
        except IntegrityError:  # a damaged blob: the blob pass reports it
            return
        wanted = sorted({address for found in files.values() for address in found or []})
        present: set[str] = set()
        for part in chunks(wanted):
            present.update(self._conn.execute(
                sa.select(blobs.c.hash).where(blobs.c.hash.in_(part))).scalars())
        for step_id, tree in named.items():
            if files[tree] is None:
                self._problems.append(
                    f"step {step_id[:12]}: workspace tree {tree[:12]} is missing")
            for address in files[tree] or []:
                if address not in present:
                    self._problems.append(f"step {step_id[:12]}: workspace file blob "
                                          f"{address[:12]} (tree {tree[:12]}) is missing")

    def _report_missing(self, values: dict[str, dict[str, Any]],
                        entries: dict[str, dict[str, Any]], missing: set[str]) -> None:
        for step_id, value in values.items():
            named = list(value["payload"].items()) + [
                (f"{key}[{index}]", address) for key, entry in entries[step_id].items()
                for index, address in enumerate(entry["items"])]
            for key, address in named:
                if address in missing:
                    self._problems.append(
                        f"step {step_id[:12]}: blob {address[:12]} ({key}) is missing")

    def _check_json(self, addresses: list[str]) -> set[str]:
        """Check the blobs at `addresses` are canonical JSON; return those that exist."""
        found: set[str] = set()
        query = sa.select(blobs.c.hash, blobs.c.size, blobs.c.codec, blobs.c.data)
        for part in chunks(addresses):
            page = {address: codec.Kept(size, kept_as, bytes(data))
                    for address, size, kept_as, data in self._conn.execute(
                        query.where(blobs.c.hash.in_(part)))}
            found.update(page)
            self._blobs.set_all(page, True)
            for address, content in codec.decode_rows(self._conn, page).items():
                if isinstance(content, IntegrityError):
                    continue  # reported by _check_blobs
                try:
                    decode_json_blob(content)
                except (IntegrityError, UsageError) as exc:  # UsageError: nested past the limit
                    # Hashed only now: a blob that is not what its address says has that problem.
                    if _blob_problem(address, page[address].size, content) is None:
                        self._report_json(address, f"blob {address[:12]}: {exc}")
        return found

    def _report_json(self, address: str, problem: str) -> None:
        if address not in self._bad_json:
            self._bad_json.add(address)
            self._problems.append(problem)

def _check_body(row: Any, problems: list[str]) -> dict[str, Any] | None:
    label = f"step {row.id[:12]}"
    try:
        body = bodies.decode(row.body, row.body_codec)
    except IntegrityError as exc:
        problems.append(f"{label}: body kept as {row.body_codec!r} does not decode (tampered): "
                        f"{exc}")
        return None
    if hashlib.sha256(body).hexdigest() != row.id:
        problems.append(f"{label}: body does not hash to its id (tampered)")
        return None
    try:
        value = decode_body(body)
    except (IntegrityError, UsageError) as exc:  # UsageError: nested past the limit
        problems.append(f"{label}: {exc}")
        return None
    if value["parent"] != row.parent_id or value["kind"] != row.kind:
        problems.append(f"{label}: parent or kind column disagrees with the hashed body")
    return value


def _blob_problem(address: str, size: int, data: bytes) -> str | None:
    label = f"blob {address[:12]}"
    if hashlib.sha256(data).hexdigest() != address:
        return f"{label}: content does not hash to its address"
    if len(data) != size:
        return f"{label}: size {len(data)} != recorded {size}"
    return None
