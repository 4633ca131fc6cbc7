"""The Store: the database's engine and transactions (store/database.py), with a
repository per aggregate as its attributes, and the migrations that make its schema.

    store.jobs      jobs' rows at submit, and every read of them (store/jobs.py)
    store.runs      a job's claim, first token and end, cancel or expiry (store/runs.py)
    store.sessions  chat sessions (store/sessions.py)
    store.tenants   tenants and their API keys (store/tenants.py)
    store.traffic   arrivals per lane and minute (store/traffic.py)

Batches, webhooks, usage and retention are repositories made on a Store by the code that
uses them (store/batches.py, store/webhooks.py, store/usage.py, store/retention.py).
Every method opens a short transaction and returns frozen records (store/records.py), so
one Store is shared by all threads of a process.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from store.database import Database
from store.engine import CONNECT_TIMEOUT_S, STATEMENT_TIMEOUT_S, normalize_url
from store.jobs import Jobs
from store.runs import Runs
from store.sessions import Sessions
from store.tenants import Tenants
from store.traffic import Traffic

if TYPE_CHECKING:
    from alembic.config import Config

# Resolved from this file, so it works from any cwd and from an installed package.
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


class Store(Database):
    def __init__(self, url: str, *, connect_timeout_s: int = CONNECT_TIMEOUT_S,
                 statement_timeout_s: float = STATEMENT_TIMEOUT_S, **engine_options: Any) -> None:
        super().__init__(url, connect_timeout_s=connect_timeout_s,
                         statement_timeout_s=statement_timeout_s, **engine_options)
        self.jobs = Jobs(self)
        self.runs = Runs(self)
        self.sessions = Sessions(self)
        self.tenants = Tenants(self)
        self.traffic = Traffic(self)


def alembic_config(url: str) -> Config:
    # Alembic is imported here, not at the top: every process imports the store, only
    # `tidegate db upgrade` migrates, and its import is a seventh of a restarted API's
    # start (which is how long its streams wait).
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    rendered = normalize_url(url).render_as_string(hide_password=False)
    # The config is a ConfigParser: a literal % (in an encoded password) must be doubled.
    config.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Run the Alembic migrations on the database at url."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)
