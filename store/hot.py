"""The statements every job runs, on PostgreSQL: straight on the driver's connection.

A worker's claim through SQLAlchemy's Connection, in a transaction, cost 620-740 us of
its CPU on PostgreSQL (a SELECT and an UPDATE, with BEGIN and COMMIT); the same claim as
one UPDATE run by psycopg itself, prepared and in autocommit, 110 us (bench/README.md,
"Where the time goes, third round"). Per statement SQLAlchemy's execution context,
parameter and result handling cost about 200 us, BEGIN and COMMIT two round trips.

So the statements a job runs every time (its claim, its first token, its end, its row's
insert and read) run here: each is one statement, atomic on its own, so autocommit is as
safe as the transaction it replaces. The statements stay SQLAlchemy Core objects (written
once, in store/jobs.py and store/runs.py), compiled once for the engine's dialect; the
connection is the engine pool's, with its checks (store/engine.py). Errors come back as SQLAlchemy's
(OperationalError, IntegrityError), which callers already handle, and a connection the
database dropped is thrown out of the pool, as SQLAlchemy would.

SQLite keeps SQLAlchemy's path: its writes must go through one BEGIN IMMEDIATE at a time.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from enum import Enum
from typing import Any, TypeVar

import psycopg
from sqlalchemy import JSON, Engine, exc
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement

T = TypeVar("T")
# A statement's parameters by name (a row read back is a dict of its columns).
Params = Mapping[str, object]


class HotStatements:
    """Runs prebuilt Core statements on the engine's PostgreSQL driver connections."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._prepared: dict[int, _Prepared] = {}
        self._lock = threading.Lock()

    @staticmethod
    def serves(engine: Engine) -> bool:
        return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"

    def rows(self, stmt: ClauseElement, params: Params) -> list[dict[str, Any]]:
        """The rows the statement returns (RETURNING, SELECT), as dicts by column name."""
        return self.rows_together([(stmt, params)])[0]

    def rowcount(self, stmt: ClauseElement, params: Params) -> int:
        prepared = self._prepare(stmt)
        values = prepared.values(params)
        return self._on_connection(prepared.sql, values, lambda conn: conn.execute(
            prepared.sql, values, prepare=True).rowcount)

    def rows_together(self, statements: Sequence[tuple[ClauseElement, Params]]
                      ) -> list[list[dict[str, Any]]]:
        """Each statement's rows; two or more in one transaction, one alone in autocommit."""
        runs = [(prepared, prepared.values(params))
                for prepared, params in ((self._prepare(stmt), params)
                                         for stmt, params in statements)]

        def run(conn: psycopg.Connection[Any]) -> list[list[dict[str, Any]]]:
            if len(runs) == 1:
                return [_run(conn, *runs[0])]
            with conn.transaction():
                return [_run(conn, prepared, values) for prepared, values in runs]

        return self._on_connection(runs[0][0].sql, runs[0][1], run)

    def _on_connection(self, sql: str, values: Params,
                       work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """work(a pooled driver connection in autocommit); a driver error as SQLAlchemy's
        (`sql` and `values` name the statement in it)."""
        try:
            fairy = self._engine.raw_connection()  # the pool's checkout checks apply
        except psycopg.Error as error:  # no connection to be had (the database is down)
            raise exc.DBAPIError.instance(sql, values, error, psycopg.Error,
                                          dialect=self._engine.dialect) from error
        try:
            conn: psycopg.Connection[Any] = fairy.driver_connection  # type: ignore[assignment]
            conn.autocommit = True
            try:
                return work(conn)
            finally:
                if not conn.closed:
                    conn.autocommit = False  # as the pool hands it to SQLAlchemy
        except psycopg.Error as error:
            raise self._translated(error, fairy, sql, values) from error
        finally:
            fairy.close()  # back to the pool

    def _prepare(self, stmt: ClauseElement) -> _Prepared:
        # Keyed by identity: the statements are module constants, each kept alive by its
        # _Prepared.
        found = self._prepared.get(id(stmt))
        if found is None:
            with self._lock:
                compiled = stmt.compile(dialect=self._engine.dialect)
                assert isinstance(compiled, SQLCompiler)
                found = _Prepared(stmt, compiled)
                self._prepared[id(stmt)] = found
        return found

    def _translated(self, error: psycopg.Error, fairy: PoolProxiedConnection, sql: str,
                    values: Params) -> exc.StatementError:
        dropped = self._engine.dialect.is_disconnect(
            error, fairy.dbapi_connection, None)  # type: ignore[arg-type]
        if dropped:
            # As SQLAlchemy's Connection does on a disconnect: this connection, and every
            # other made before it, is replaced at its next checkout; the caller retries.
            self._engine.pool._invalidate(fairy, error)
        return exc.DBAPIError.instance(sql, values, error, psycopg.Error,
                                       connection_invalidated=dropped,
                                       dialect=self._engine.dialect)


class _Prepared:
    """One statement compiled for the dialect, and the names of the columns it returns
    (read once: psycopg builds a Column object per column for each `description`)."""

    def __init__(self, stmt: ClauseElement, compiled: SQLCompiler) -> None:
        self.stmt = stmt
        self.compiled = compiled
        self.sql = compiled.string
        self.names: list[str] | None = None
        # JSON parameters go as text, which the SQL casts (SQLAlchemy's serializer, json).
        self.json = frozenset(name for name, bind in compiled.binds.items()
                              if isinstance(bind.type, JSON))

    def values(self, params: Params) -> dict[str, object]:
        values = self.compiled.construct_params(params) or {}
        return {name: _json(value) if name in self.json else _plain(value)
                for name, value in values.items()}

    def fetch(self, cursor: psycopg.Cursor[Any]) -> list[dict[str, Any]]:
        if self.names is None:
            self.names = [column.name for column in cursor.description or ()]
        names = self.names
        return [{name: _utc(value) for name, value in zip(names, row, strict=True)}
                for row in cursor.fetchall()]


def _run(conn: psycopg.Connection[Any], prepared: _Prepared,
         values: Params) -> list[dict[str, Any]]:
    return prepared.fetch(conn.execute(prepared.sql, values, prepare=True))


def _json(value: object) -> str | None:
    return None if value is None else json.dumps(value)


def _plain(value: object) -> object:
    """What the driver sends for an enum (the job statuses): its value."""
    return value.value if isinstance(value, Enum) else value


def _utc(value: object) -> object:
    """A timestamp in UTC, as store.models.UTCDateTime reads it (psycopg gives the
    session's time zone)."""
    return value.astimezone(UTC) if isinstance(value, datetime) else value
