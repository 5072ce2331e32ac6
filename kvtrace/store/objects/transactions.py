"""The transaction each of the store's writes runs in: a batch's, or its own.

A batch (`Transactions.batch`) runs every write of the thread that opened it
in one transaction, its appends' ref moves made once at its end
(batched.py). Any other write gets a transaction of its own: on SQLite on a
connection held for writes, handed to one thread at a time; on PostgreSQL
from the pool.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.engine import Connection, Engine

from kvtrace.errors import UsageError
from kvtrace.store.db.backend import write_transaction
from kvtrace.store.objects.batched import BatchedMoves


class Transactions:
    """Write transactions on one engine (see the module docstring)."""

    def __init__(self, writer: Engine) -> None:
        self._writer = writer
        # (thread, its transaction, its appends' ref moves waiting for the batch's end)
        self._batch: tuple[int, Connection, BatchedMoves] | None = None
        # SQLite: one connection held for writes (see write), and the lock that gives it
        # to one thread at a time.
        self._held: Connection | None = None
        self._held_lock = threading.Lock()

    def close(self) -> None:
        """Release the held connection."""
        with self._held_lock:
            if self._held is not None:
                self._held.close()
                self._held = None

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Run every write inside in one transaction: all of it lands, or none of it.

        What an import needs: a document recorded as many steps appears whole
        or not at all, even if the database fails half-way. Batches do not
        nest, and a batch belongs to the thread that opened it. Inside a batch,
        write through `Run` objects (which remember their head): reads open
        their own transaction and do not see the batch's writes until it ends.

        Appends move their run once, when the batch's work is done
        (batched.py), with one reflog entry (reason `batch`) that `undo`
        takes back whole: a run moved by another writer meanwhile, or paused,
        fails the batch then (ConflictError, RunPausedError), writing nothing.
        """
        if self._batch is not None:
            raise UsageError("store batches do not nest")
        with write_transaction(self._writer) as conn:
            moves = BatchedMoves()
            self._batch = (threading.get_ident(), conn, moves)
            try:
                yield
                moves.flush(conn)
            finally:
                self._batch = None

    def batch_moves(self) -> BatchedMoves | None:
        """The waiting ref moves of the batch this thread opened, if it opened one."""
        batch = self._batch
        return batch[2] if batch is not None and batch[0] == threading.get_ident() else None

    @contextmanager
    def write(self, *, flush: bool = True) -> Iterator[Connection]:
        """The batch's transaction in the thread that opened it, else a new write transaction.

        In a batch, the appends' waiting ref moves are made first (unless
        `flush` is False: an append that adds its own), so that a fork, a
        revert or a new run sees the heads they left.

        Other threads never write through a batch: they wait for the database's
        write lock (SQLite) or row locks (PostgreSQL) as with any writer.

        On SQLite the transaction runs on a connection the store holds: taking
        one from the pool and giving it back cost a fifth of an append
        (~17 µs). SQLite runs one write transaction at a time anyway, so
        threads queueing for the held connection lose no concurrency.
        PostgreSQL writers use the pool and run side by side.
        """
        batch = self._batch
        if batch is not None and batch[0] == threading.get_ident():
            if flush:
                batch[2].flush(batch[1])
            yield batch[1]
            return
        if self._writer.dialect.name != "sqlite":
            with write_transaction(self._writer) as conn:
                yield conn
            return
        with self._held_lock:
            if self._held is None:
                self._held = self._writer.connect()
            try:
                with write_transaction(self._held) as conn:
                    yield conn
            except BaseException:
                # A write that failed (a conflict too: rare) hands the connection
                # back: whatever state a failed BEGIN or COMMIT left, the next
                # write starts on a connection from the pool.
                self._held.close()
                self._held = None
                raise
