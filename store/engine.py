"""Engine construction for SQLite and PostgreSQL.

SQLite is used from many threads at once (a Celery threads-pool worker, FastAPI), so each
connection gets WAL (readers do not block the writer), a busy timeout (writers wait for
each other instead of failing) and explicit transactions: writes start with
BEGIN IMMEDIATE so a transaction that reads then writes cannot hit SQLITE_BUSY halfway.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
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
    # Long-lived workers outlive database restarts; check connections before use.
    options.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **options)


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
