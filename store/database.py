"""The engine and its transactions: what every repository of the store reads and writes
through (store/jobs.py, store/runs.py, store/sessions.py, store/tenants.py, ...).

A transaction is short and opened per call, so one Database is shared by all threads of
a process. Writes on SQLite queue on a lock of this process (one writer at a time); on
PostgreSQL the statements every job runs go straight to the driver (store/hot.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session, sessionmaker

from store.engine import (
    CONNECT_TIMEOUT_S,
    STATEMENT_TIMEOUT_S,
    WRITE_OPTION,
    is_sqlite_memory,
    make_engine,
    normalize_url,
)
from store.hot import HotStatements
from store.models import Base


class Database:
    def __init__(self, url: str, *, connect_timeout_s: int = CONNECT_TIMEOUT_S,
                 statement_timeout_s: float = STATEMENT_TIMEOUT_S, **engine_options: Any) -> None:
        """The database at `url`. On PostgreSQL a connection that cannot be made within
        `connect_timeout_s`, or a statement running longer than `statement_timeout_s` (0:
        no bound), fails with OperationalError (store/engine.py)."""
        self.url = normalize_url(url)
        self.engine = make_engine(self.url, connect_timeout_s=connect_timeout_s,
                                  statement_timeout_s=statement_timeout_s, **engine_options)
        self.sessionmaker = sessionmaker(self.engine, expire_on_commit=False)
        self._write_engine = self.engine.execution_options(**{WRITE_OPTION: True})
        self._write_sessions = sessionmaker(self._write_engine, expire_on_commit=False)
        # In-memory SQLite is one shared connection: it can hold one transaction at a time.
        self._serial: AbstractContextManager[object] = (
            threading.Lock() if is_sqlite_memory(self.url) else nullcontext()
        )
        # SQLite has one writer at a time. Threads of this process queue on a lock, in
        # order, instead of in SQLite's busy handler, which sleeps in growing steps and
        # turned a 64-job burst's writes into waits of seconds.
        sqlite_file = self.url.get_backend_name() == "sqlite" and not is_sqlite_memory(self.url)
        self._writer: AbstractContextManager[object] = (
            threading.Lock() if sqlite_file else nullcontext()
        )
        # PostgreSQL: the statements every job runs, on the driver itself (store/hot.py).
        self.hot = HotStatements(self.engine) if HotStatements.serves(self.engine) else None

    @property
    def dialect(self) -> str:
        """The engine's dialect name ("sqlite", "postgresql")."""
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    def create_schema(self) -> None:
        """Create the tables without migrations (tests)."""
        Base.metadata.create_all(self.engine)

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._serial, self.sessionmaker() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        with self._writer, self._serial, self._write_sessions.begin() as session:
            yield session

    # The paths every job takes (a worker's claim, first token and end; a submit's count
    # and read) run on Core connections: the ORM session cost 2-3x the CPU of the same
    # statements (bench/README.md, "Where the time goes").
    @contextmanager
    def read_conn(self) -> Iterator[Connection]:
        with self._serial, self.engine.connect() as conn:
            yield conn

    @contextmanager
    def write_conn(self) -> Iterator[Connection]:
        with self._writer, self._serial, self._write_engine.begin() as conn:
            yield conn
