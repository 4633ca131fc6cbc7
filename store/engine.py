"""Engine construction for SQLite and PostgreSQL.

SQLite is used from many threads at once (a Celery threads-pool worker, FastAPI), so each
connection gets WAL (readers do not block the writer), a busy timeout (writers wait for
each other instead of failing) and explicit transactions: writes start with
BEGIN IMMEDIATE so a transaction that reads then writes cannot hit SQLITE_BUSY halfway.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.pool import StaticPool

SQLITE_BUSY_TIMEOUT_MS = 30_000
# Execution option carried by the store's write sessions; read in the "begin" hook.
WRITE_OPTION = "tidegate_write"


def normalize_url(url: str | URL) -> URL:
    """Parse a database URL; plain postgresql:// URLs get the installed psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def is_sqlite_memory(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def make_engine(url: str | URL, **options: Any) -> Engine:
    """An Engine for url; options go to create_engine."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, options)
    # Long-lived workers outlive database restarts: a connection is checked before use,
    # unless it was in use a moment ago (SQLAlchemy's pool_pre_ping checks every
    # checkout: a round trip that was a tenth of a submit's and of a job's store time).
    # SQLAlchemy's default pool keeps 5 connections (15 at most): a worker's task threads
    # opened and closed a connection for each statement over 5, 1 in 10 of its CPU
    # samples under load (bench/README.md). 16 at most: six processes (four workers, the
    # API, the scheduler) stay under PostgreSQL's default max_connections. All 16 are kept:
    # with 12 kept and 4 more on demand, the pool still closed and opened connections
    # under load, 3.4% of a worker's CPU (bench/README.md, "fourth round"); a thread
    # past the 16th waits for one to come back.
    options.setdefault("pool_size", 16)
    options.setdefault("max_overflow", 0)
    engine = create_engine(parsed, **options)
    if not options.get("pool_pre_ping"):
        _ping_when_idle(engine, PING_WHEN_IDLE_S)
    return engine


PING_WHEN_IDLE_S = 1.0  # a pooled connection idle longer is pinged when checked out


def _ping_when_idle(engine: Engine, idle_s: float) -> None:
    """Before a checkout, ping the connection if it was checked in over `idle_s` ago; a
    dead one makes the pool connect anew (DisconnectionError: the pool's own retry). A
    database that restarts under a connection used less than `idle_s` before fails that
    one use, which the callers retry (workers/retry.py) or answer 503 (the API), and the
    pool then drops every connection made before the failure."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi: Any, record: Any) -> None:
        record.info["tidegate_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("tidegate_idle_since")
        if since is None or time.monotonic() - since < idle_s:
            return  # just connected, or in use a moment ago
        try:
            alive = engine.dialect.do_ping(dbapi)
        except Exception as exc:
            raise DisconnectionError("the pooled connection is dead") from exc
        if not alive:
            raise DisconnectionError("the pooled connection is dead")


def _sqlite_engine(url: URL, options: dict[str, Any]) -> Engine:
    connect_args = {"check_same_thread": False, **options.pop("connect_args", {})}
    if is_sqlite_memory(url):
        # Each connection to :memory: is a different database: share one connection.
        options.setdefault("poolclass", StaticPool)
    if not is_sqlite_memory(url):
        # A worker runs one thread per engine slot, each with its own connection.
        options.setdefault("pool_size", 16)
        options.setdefault("max_overflow", 64)
    engine = create_engine(url, connect_args=connect_args, **options)
    event.listen(engine, "connect", _sqlite_connect)
    event.listen(engine, "begin", _sqlite_begin)
    return engine


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # Turn off pysqlite's own transaction handling; _sqlite_begin emits BEGIN instead.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode = WAL")
    # With WAL, NORMAL syncs at checkpoints rather than every commit: a crash keeps the
    # database consistent; only a power loss can drop the last commits.
    cursor.execute("PRAGMA synchronous = NORMAL")
    cursor.execute("PRAGMA foreign_keys = ON")  # same integrity as PostgreSQL
    cursor.close()


def _sqlite_begin(connection: Connection) -> None:
    write = connection.get_execution_options().get(WRITE_OPTION, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
