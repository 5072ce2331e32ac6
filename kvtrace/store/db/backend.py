"""Database connection for the store: one SQLAlchemy engine, two dialects.

SQLite (embedded default) runs in WAL mode with a busy timeout, and write
transactions start with ``BEGIN IMMEDIATE`` so two writers queue instead of
failing when a read lock would have to be upgraded. Durability is the URL's
``?synchronous=`` (``normal`` by default: a committed step survives a crash of
the process, not of the machine; ``full`` or ``extra``: it survives a power
loss too, at an fsync per commit), see docs/store.md. PostgreSQL (psycopg 3)
needs nothing special: a ref's compare-and-swap is one conditional UPDATE,
which READ COMMITTED re-evaluates after a concurrent writer commits.

PostgreSQL may still abort a transaction to break a deadlock or a
serialization failure (SQLSTATE 40P01, 40001): that becomes RetryableError,
and `retried` runs a whole store method again, which is safe because each
method is one transaction and an aborted one wrote nothing. Rows that several
writers may insert at once (blobs, steps) go in in key order, so two writers
never wait on each other in a cycle in the first place.

The schema is brought up to date by alembic migrations when a store opens,
in one transaction; a store already at the expected revision skips alembic.
"""

from __future__ import annotations

import functools
import random
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.compiler import SQLCompiler

from kvtrace.errors import RetryableError, StoreError, StoreFullError
from kvtrace.store.db.schema import SCHEMA_REVISION, Address, raw_or_none

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
_WRITE = "kvtrace_write"
# SQLSTATEs of a transaction the server aborted on purpose (nothing was written).
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected
DISK_FULL_SQLSTATE = "53100"  # PostgreSQL's disk_full
MIN_FREE_BYTES = 1024 * 1024  # a SQLite folder with less free is full (`_is_sqlite_disk_full`)
MAX_ATTEMPTS = 8
SQLITE_SYNCHRONOUS = ("normal", "full", "extra")  # the first is the default; never "off"
_P = ParamSpec("_P")
_T = TypeVar("_T")


def safe_url(url: str) -> str:
    """`url` with any password masked, for messages and output."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "<unparseable URL>"


def create_db_engine(url: str) -> Engine:
    """An engine for `url` with the per-dialect settings the store relies on."""
    if "://" not in url:  # a path given where a URL belongs: say the URL it means
        raise StoreError(f"{url!r} is not a store URL: for a SQLite file write "
                         f"'sqlite:///{url}' (PostgreSQL: 'postgresql://HOST/DATABASE')")
    try:
        parsed = sa.engine.make_url(url)
        synchronous = parsed.query.get("synchronous", SQLITE_SYNCHRONOUS[0])
        if parsed.get_backend_name() == "sqlite":
            parsed = parsed.difference_update_query(["synchronous"])
        engine = sa.create_engine(parsed)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ImportError) as exc:
        raise StoreError(f"cannot use store URL {safe_url(url)!r}: {exc}") from exc
    if engine.dialect.name == "sqlite":
        if not isinstance(synchronous, str) or synchronous.lower() not in SQLITE_SYNCHRONOUS:
            engine.dispose()
            raise StoreError(
                f"synchronous={synchronous!r} in {safe_url(url)!r}: use one of "
                f"{', '.join(SQLITE_SYNCHRONOUS)}"
            )
        _configure_sqlite(engine, synchronous.upper())
    elif engine.dialect.name != "postgresql":
        raise StoreError(
            f"unsupported database {engine.dialect.name!r}: use sqlite:/// or postgresql+psycopg://"
        )
    return engine


def _set_wal(cursor: Any) -> None:
    """Switch to WAL, retrying: SQLite may refuse the switch with "database is
    locked" at once, without its busy handler, while another connection is
    opening the same new file."""
    for _ in range(200):
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                raise
            time.sleep(0.05)
    cursor.execute("PRAGMA journal_mode=WAL")


def _configure_sqlite(engine: Engine, synchronous: str) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control from pysqlite so that BEGIN is ours to emit.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA busy_timeout=30000")
        _set_wal(cursor)
        cursor.execute(f"PRAGMA synchronous={synchronous}")  # one of SQLITE_SYNCHRONOUS
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Straight to the driver: through exec_driver_sql, BEGIN cost more than
        # a whole append's statements (see Prepared).
        sql = "BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE, False) else "BEGIN"
        try:
            conn.connection.dbapi_connection.execute(sql)  # type: ignore[union-attr]
        except sqlite3.Error as exc:
            raise sa.exc.DBAPIError.instance(sql, (), exc, sqlite3.Error) from exc


def reader(engine: Engine) -> Engine:
    """A view of `engine` whose transactions see one snapshot throughout.

    SQLite in WAL mode already reads from one snapshot per transaction; on
    PostgreSQL READ COMMITTED would give each statement its own, so a reader
    (fsck, log) could see a step written after the blobs it read.
    """
    if engine.dialect.name == "postgresql":
        return engine.execution_options(isolation_level="REPEATABLE READ")
    return engine


def writer(engine: Engine) -> Engine:
    """A view of `engine` whose transactions intend to write (BEGIN IMMEDIATE on SQLite)."""
    return engine.execution_options(**{_WRITE: True})


@contextmanager
def write_transaction(engine: Engine | Connection) -> Iterator[Connection]:
    """A transaction on a `writer` engine, or on a connection of one: all of it
    lands or none of it."""
    try:
        if isinstance(engine, Connection):
            with engine.begin():
                yield engine
        else:
            with engine.begin() as conn:
                yield conn
    except sa.exc.SQLAlchemyError as exc:
        raise _translate(exc, "database write failed", engine) from exc


@contextmanager
def read_transaction(engine: Engine) -> Iterator[Connection]:
    """A read-only transaction (a consistent snapshot on both backends)."""
    try:
        with engine.begin() as conn:
            yield conn
    except sa.exc.SQLAlchemyError as exc:
        raise _translate(exc, "database read failed", engine) from exc


def _translate(exc: sa.exc.SQLAlchemyError, what: str,
               engine: Engine | Connection | None = None) -> StoreError:
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if sqlstate in RETRYABLE_SQLSTATES:
        return RetryableError(
            f"{what}: the database aborted the transaction ({_reason(exc)}); nothing was "
            "written: make the same call again"
        )
    url = engine.engine.url if engine is not None else None
    if sqlstate == DISK_FULL_SQLSTATE or _is_sqlite_disk_full(exc, url):
        where = safe_url(url.render_as_string()) if url is not None else "the store"
        landed = "; nothing of this write landed" if "write" in what else ""
        return StoreFullError(f"{what}: the disk under {where} is full "
                              f"({_reason(exc)}){landed}: free some space")
    return StoreError(f"{what}: {_reason(exc)}")


def _is_sqlite_disk_full(exc: sa.exc.SQLAlchemyError, url: sa.URL | None) -> bool:
    """SQLite says "database or disk is full"; on a write-ahead log that cannot grow it may
    say "disk I/O error" instead: that counts when the database's folder has no room."""
    reason = _reason(exc)
    if "database or disk is full" in reason:
        return True
    if "disk I/O error" not in reason or url is None or url.get_backend_name() != "sqlite":
        return False
    folder = Path(url.database or ".").resolve().parent
    try:
        return shutil.disk_usage(folder).free < MIN_FREE_BYTES
    except OSError:
        return False


def retried(method: Callable[_P, _T]) -> Callable[_P, _T]:
    """Run `method` (one store transaction) again when the database aborted it.

    Up to MAX_ATTEMPTS calls with a short random back-off; the last
    RetryableError reaches the caller.
    """

    @functools.wraps(method)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        for attempt in range(MAX_ATTEMPTS - 1):
            try:
                return method(*args, **kwargs)
            except RetryableError:
                time.sleep(random.uniform(0, 0.001 * 2**attempt))
        return method(*args, **kwargs)

    return call


def _reason(exc: sa.exc.SQLAlchemyError) -> str:
    orig = getattr(exc, "orig", None)
    return str(orig if orig is not None else exc).strip().splitlines()[0]


class Prepared:
    """A statement compiled once per driver and run by the driver itself, in the
    caller's SQLAlchemy transaction.

    SQLAlchemy's execution layer (an execution context, events, a result
    object) costs 30-100 µs per statement, ten times what SQLite takes to run
    a small insert; an append runs five statements. The append path's
    statements are built once at import, compiled on first use, and handed to
    the DBAPI cursor. A driver error is raised as SQLAlchemy's DBAPIError, so
    the translation at the boundary (`_translate`) sees what it always sees.

    Only for statements whose every parameter is given by name at each call
    (no defaults, no expanding IN lists: write such lists as literals).
    `statements` maps a dialect name to its own statement where they differ
    (an upsert); `default` serves the others. A parameter bound to a column
    whose type converts values (an address, kept as raw bytes: schema.Address)
    is converted as SQLAlchemy would; rows come back as the driver gives them.
    """

    def __init__(
        self, default: sa.ClauseElement | None = None, **statements: sa.ClauseElement
    ) -> None:
        self._statements = statements
        self._default = default
        self._compiled: dict[tuple[str, str], _Compiled] = {}

    def _sql(self, dialect: sa.Dialect) -> _Compiled:
        key = (dialect.name, dialect.driver)
        found = self._compiled.get(key)
        if found is None:
            statement = self._statements.get(dialect.name, self._default)
            if statement is None:
                raise StoreError(f"no statement for the {dialect.name} database")
            compiled = statement.compile(dialect=dialect)
            if not isinstance(compiled, SQLCompiler):
                raise StoreError(f"not a SQL statement: {statement!r}")
            fixed = sorted(name for name, bind in compiled.binds.items() if bind.value is not None)
            if fixed:  # a value built into the statement would be silently dropped
                raise StoreError(f"a Prepared statement takes every parameter by name: {fixed}")
            names = tuple(compiled.positiontup or ()) if dialect.positional else None
            converters = {name: convert for name, bind in compiled.binds.items()
                          if (convert := bind_converter(bind.type, dialect)) is not None}
            found = self._compiled[key] = _Compiled(
                compiled.string, names, tuple(converters.items()),
                tuple((name, converters.get(name)) for name in names or ()))
        return found

    def _cursor(self, conn: Connection) -> tuple[Any, _Compiled]:
        compiled = self._sql(conn.dialect)
        return conn.connection.dbapi_connection.cursor(), compiled  # type: ignore[union-attr]

    def execute(self, conn: Connection, params: Mapping[str, Any]) -> int:
        """Run it once; the number of rows it changed."""
        cursor, compiled = self._cursor(conn)
        sql, args = compiled.sql, compiled.args(params)
        try:
            cursor.execute(sql, args)
            return int(cursor.rowcount)
        except conn.dialect.loaded_dbapi.Error as exc:
            raise _driver_error(conn, sql, args, exc) from exc
        finally:
            cursor.close()

    def first(self, conn: Connection, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """Run a query; its first row, or None."""
        cursor, compiled = self._cursor(conn)
        sql, args = compiled.sql, compiled.args(params)
        try:
            cursor.execute(sql, args)
            row = cursor.fetchone()
            return tuple(row) if row is not None else None
        except conn.dialect.loaded_dbapi.Error as exc:
            raise _driver_error(conn, sql, args, exc) from exc
        finally:
            cursor.close()

    def execute_many(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        """Run it once per row of parameters."""
        if not rows:
            return
        cursor, compiled = self._cursor(conn)
        sql, args = compiled.sql, [compiled.args(row) for row in rows]
        try:
            cursor.executemany(sql, args)
        except conn.dialect.loaded_dbapi.Error as exc:
            raise _driver_error(conn, sql, args, exc) from exc
        finally:
            cursor.close()


class _Compiled(NamedTuple):
    """A Prepared statement as one driver runs it."""

    sql: str
    names: tuple[str, ...] | None  # the parameters in order (a positional driver), or None
    converters: tuple[tuple[str, Callable[[Any], Any]], ...]  # (parameter, its conversion)
    # A positional driver's parameters in order, each with its conversion or None.
    order: tuple[tuple[str, Callable[[Any], Any] | None], ...]

    def args(self, params: Mapping[str, Any]) -> Any:
        """What the driver is given for `params`."""
        if self.names is not None:
            return tuple([params[name] if convert is None else convert(params[name])
                          for name, convert in self.order])
        if self.converters:
            return {**params, **{name: convert(params[name])
                                 for name, convert in self.converters}}
        return params


def bind_converter(type_: sa.types.TypeEngine[Any], dialect: sa.Dialect
                   ) -> Callable[[Any], Any] | None:
    """How SQLAlchemy converts a value bound as `type_` before the driver sees it (an
    address to its raw bytes), for the statements run without it; None: no conversion."""
    if isinstance(type_, Address):
        return raw_or_none  # the same, one call less: every append converts ~10 addresses
    if not isinstance(type_, sa.TypeDecorator):
        return None
    process = type_.process_bind_param
    return lambda value: process(value, dialect)


def _driver_error(conn: Connection, sql: str, args: Any, exc: Exception) -> sa.exc.StatementError:
    return sa.exc.DBAPIError.instance(
        sql, args, exc, conn.dialect.loaded_dbapi.Error, dialect=conn.dialect)


def insert_ignore(
    conn: Connection, table: sa.Table, rows: Sequence[Mapping[str, Any]], key: str
) -> None:
    """Insert rows, skipping those whose `key` already exists (content-addressed dedup)."""
    if rows and conn.dialect.name != "postgresql":
        _insert_ignore_statement(table, key).execute_many(conn, rows)
    elif rows:
        _insert_unnested(conn, table, rows, key)


def insert_rows(conn: Connection, table: sa.Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert rows, in order (each row gives every column it sets, all rows the same ones)."""
    if rows and conn.dialect.name != "postgresql":
        _insert_statement(table, tuple(rows[0])).execute_many(conn, rows)
    elif rows:
        _insert_unnested(conn, table, rows, None)


def _insert_unnested(
    conn: Connection, table: sa.Table, rows: Sequence[Mapping[str, Any]], key: str | None
) -> None:
    """PostgreSQL: the rows in one statement, as one array per column (`unnest`), in order.

    psycopg's executemany runs a pipeline that waits on the server several
    times (1.9 ms for an append's two or three blobs, against 0.5 ms for one
    statement); SQLite's executemany stays in the process and needs no such thing.
    """
    columns = tuple(rows[0])
    # The arrays are bound as a whole: each address in them is converted here.
    converters = {column: bind_converter(table.c[column].type, conn.dialect) for column in columns}
    for start in range(0, len(rows), _UNNEST_ROWS):
        part = rows[start:start + _UNNEST_ROWS]
        arrays: dict[str, list[Any]] = {}
        for column, convert in converters.items():
            values = [row[column] for row in part]
            arrays[column] = values if convert is None else [convert(v) for v in values]
        _unnest_statement(table, columns, key).execute(conn, arrays)


_UNNEST_ROWS = 1000  # rows per statement: a bundle's thousands of blobs go in a few


@functools.cache
def _unnest_statement(table: sa.Table, columns: tuple[str, ...], key: str | None) -> Prepared:
    """INSERT ... SELECT FROM unnest(one array per column) [ON CONFLICT DO NOTHING].

    With no conflict target: `blobs` keeps its addresses unique by an exclusion
    constraint (migration 0009), which a target naming a column cannot name.
    """
    dialect = postgresql.dialect()
    arrays = ", ".join(
        f"CAST(:{column} AS {table.c[column].type.compile(dialect=dialect)}[])"
        for column in columns)
    conflict = " ON CONFLICT DO NOTHING" if key else ""
    return Prepared(postgresql=sa.text(
        f"INSERT INTO {table.name} ({', '.join(columns)}) SELECT * FROM unnest({arrays})"
        + conflict))


@functools.cache
def _insert_statement(table: sa.Table, columns: tuple[str, ...]) -> Prepared:
    return Prepared(
        sa.insert(table).values({column: sa.bindparam(column) for column in columns}).inline())


@functools.cache
def _insert_ignore_statement(table: sa.Table, key: str) -> Prepared:
    return Prepared(
        postgresql=postgresql.insert(table).on_conflict_do_nothing(),  # see _unnest_statement
        sqlite=sqlite.insert(table).on_conflict_do_nothing(index_elements=[key]),
    )


def migrate(engine: Engine) -> None:
    """Apply pending migrations in one transaction (a no-op at the current revision)."""
    from alembic.runtime.migration import MigrationContext

    try:
        with write_transaction(writer(engine)) as conn:
            if conn.dialect.name == "postgresql":
                # Openers of a new schema queue here instead of racing to create it.
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('kvtrace-migrate'))"))
            current = MigrationContext.configure(conn).get_current_revision()
            if current == SCHEMA_REVISION:
                return
            _upgrade(conn, "head")
    except StoreError:
        raise
    except Exception as exc:  # alembic raises its own types
        raise StoreError(f"cannot migrate the store schema: {exc}") from exc


def current_revision(engine: Engine) -> str | None:
    """The schema revision of the database (None: not a kvtrace store yet)."""
    from alembic.runtime.migration import MigrationContext

    with read_transaction(engine) as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _upgrade(conn: Connection, target: str) -> None:
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = conn
    command.upgrade(config, target)
