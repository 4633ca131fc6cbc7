"""Engine construction for SQLite and PostgreSQL.

SQLite is used from many threads at once (a Celery threads-pool worker, FastAPI), so each
connection gets WAL (readers do not block the writer), a busy timeout (writers wait for
each other instead of failing) and explicit transactions: writes start with
BEGIN IMMEDIATE so a transaction that reads then writes cannot hit SQLITE_BUSY halfway.

PostgreSQL connections are bounded in time (`_postgres_connect_args`): a connection that
cannot be made within `connect_timeout_s` fails, a statement the server runs longer than
`statement_timeout_s` is cancelled by the server, and the kernel gives up on a peer that
stops acknowledging (a partition) instead of waiting out TCP's retransmissions (~15 min).
Each failure is an OperationalError, which the API answers 503 and workers retry: a
blackholed database costs a caller its timeout, never a thread for good. They apply to
the hot statements too (store/hot.py): those run on the same pool's connections.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection, StaticPool

SQLITE_BUSY_TIMEOUT_MS = 30_000
# PostgreSQL's bounds (TIDEGATE_DATABASE_CONNECT_TIMEOUT_S, _STATEMENT_TIMEOUT_S set them;
# these are their defaults, for a Store made without settings). libpq counts the connect
# timeout in whole seconds and takes 2 as its least.
CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_S = 30.0
KEEPALIVE_PROBES = 3  # unanswered TCP keepalives before the kernel drops a connection
PARTITION_S = 10  # data unacknowledged this long (at least): the peer is gone
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


def make_engine(url: str | URL, *, connect_timeout_s: int = CONNECT_TIMEOUT_S,
                statement_timeout_s: float = STATEMENT_TIMEOUT_S, **options: Any) -> Engine:
    """An Engine for url; options go to create_engine. The timeouts bound PostgreSQL's
    connections (statement_timeout_s 0: none); SQLite has its busy timeout instead."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, options)
    options["connect_args"] = {
        **_postgres_connect_args(parsed, connect_timeout_s, statement_timeout_s),
        **options.get("connect_args", {})}
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


def _postgres_connect_args(url: URL, connect_timeout_s: int,
                           statement_timeout_s: float) -> dict[str, object]:
    """libpq's connection parameters for the bounds (a parameter the URL's query sets
    itself is left as the URL has it; `options` gets the statement timeout added)."""
    if connect_timeout_s < 2:
        raise ValueError(f"connect_timeout_s {connect_timeout_s}: libpq's least is 2 s")
    args: dict[str, object] = {
        "connect_timeout": connect_timeout_s,
        # Unacknowledged data, or keepalives unanswered this long, drop the connection
        # (Linux): a partitioned server fails the statement instead of hanging it.
        "tcp_user_timeout": max(connect_timeout_s, PARTITION_S) * 1000,
        "keepalives": 1,
        "keepalives_idle": connect_timeout_s,
        "keepalives_interval": 1,
        "keepalives_count": KEEPALIVE_PROBES,
    }
    args = {name: value for name, value in args.items() if name not in url.query}
    if statement_timeout_s > 0:
        # Sent in the startup packet: no round trip of its own, in force from the first
        # statement, on every connection of the pool.
        timeout = f"-c statement_timeout={round(statement_timeout_s * 1000)}"
        given = str(url.query.get("options", ""))
        if "statement_timeout" not in given:
            args["options"] = f"{given} {timeout}".strip()
    return args


def _ping_when_idle(engine: Engine, idle_s: float) -> None:
    """Before a checkout, ping the connection if it was checked in over `idle_s` ago; a
    dead one makes the pool connect anew (DisconnectionError: the pool's own retry). A
    database that restarts under a connection used less than `idle_s` before fails that
    one use, which the callers retry (workers/retry.py) or answer 503 (the API), and the
    pool then drops every connection made before the failure."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi: DBAPIConnection, record: ConnectionPoolEntry) -> None:
        record.info["tidegate_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi: DBAPIConnection, record: ConnectionPoolEntry,
                  _proxy: PoolProxiedConnection) -> None:
        since = record.info.get("tidegate_idle_since")
        if since is None or time.monotonic() - since < idle_s:
            return  # just connected, or in use a moment ago
        try:
            alive = engine.dialect.do_ping(dbapi)
        except Exception as exc:
            raise DisconnectionError("the pooled connection is dead") from exc
        if not alive:
            raise DisconnectionError("the pooled connection is dead")


def _sqlite_engine(url: URL, options: dict[str, Any]) -> Engine:  # create_engine's options
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


def _sqlite_connect(dbapi_connection: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
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
