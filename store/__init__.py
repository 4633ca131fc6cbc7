"""The bottom layer: SQLAlchemy models and the Store that reads and writes them.

Imports nothing of the project; callers pass the database URL.
"""

from store.db import (
    MIGRATIONS_DIR,
    FirstToken,
    Store,
    alembic_config,
    hash_key,
    upgrade,
    utcnow,
)
from store.engine import make_engine, normalize_url
from store.models import (
    ACTIVE_STATUSES,
    CANCELLED,
    DONE,
    ERROR,
    EXPIRED,
    JOB_STATUSES,
    QUEUED,
    RUNNING,
    TERMINAL_STATUSES,
    Base,
    ChatSession,
    Job,
    Tenant,
)
from store.records import (
    JobRecord,
    SessionRecord,
    TenantExistsError,
    TenantRecord,
)

__all__ = [
    "ACTIVE_STATUSES",
    "CANCELLED",
    "DONE",
    "ERROR",
    "FirstToken",
    "EXPIRED",
    "JOB_STATUSES",
    "MIGRATIONS_DIR",
    "QUEUED",
    "RUNNING",
    "TERMINAL_STATUSES",
    "Base",
    "ChatSession",
    "Job",
    "JobRecord",
    "SessionRecord",
    "Store",
    "Tenant",
    "TenantExistsError",
    "TenantRecord",
    "alembic_config",
    "hash_key",
    "make_engine",
    "normalize_url",
    "upgrade",
    "utcnow",
]
