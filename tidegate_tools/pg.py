"""Private PostgreSQL databases for the tests and the benchmarks, on the server at
127.0.0.1:5432 (trust auth), so they never touch a running deployment's database."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def pg_admin(sql: str) -> None:
    """One statement outside a transaction (CREATE and DROP DATABASE need that)."""
    from sqlalchemy import create_engine

    engine = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(sql)
    finally:
        engine.dispose()


@contextmanager
def private_database(prefix: str) -> Iterator[str]:
    """A fresh, empty database (dropped first if left over, and after use); yields its URL.
    Its name is `prefix` and this process's id, so two test or benchmark sessions on one
    server never drop each other's. An unreachable server raises OperationalError."""
    name = f"{prefix}_{os.getpid()}"
    pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    pg_admin(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
