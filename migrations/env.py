"""Alembic environment for the tidegate store.

The database URL comes from the config's sqlalchemy.url (set by store.upgrade(url)), else
from TIDEGATE_DATABASE_URL.
"""

from __future__ import annotations

import os
from logging.config import fileConfig
from typing import Any, Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import create_engine, pool

from store.engine import normalize_url
from store.models import Base, UTCDateTime

config = context.config
# Only the command line has an ini file; programs keep their own logging setup.
if config.config_file_name is not None:
    fileConfig(config.config_file_name)

target_metadata = Base.metadata


def database_url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("TIDEGATE_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set sqlalchemy.url or TIDEGATE_DATABASE_URL")
    return normalize_url(url).render_as_string(hide_password=False)


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    # UTCDateTime only converts values in Python; in the database it is this column type.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def configure(database: str, **options: Any) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        render_item=render_item,
        # SQLite alters most things by copying the table; batch mode does that.
        render_as_batch=database.startswith("sqlite"),
        **options,
    )


def run_offline() -> None:
    url = database_url()
    configure(url, url=url, literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    url = database_url()
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            configure(url, connection=connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
