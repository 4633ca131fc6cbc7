"""The bottom layer: SQLAlchemy models and the Store that reads and writes them.

Imports nothing of the project but its core (tidegate); callers pass the database URL.
Job statuses are tidegate.records.JobStatus.
"""

from store.clock import utcnow
from store.db import MIGRATIONS_DIR, Store, alembic_config, upgrade
from store.engine import make_engine, normalize_url
from store.models import Base, ChatSession, Job, Tenant
from store.records import (
    JobRecord,
    SessionRecord,
    TenantExistsError,
    TenantRecord,
)
from store.runs import FirstToken
from store.tenants import hash_key

__all__ = [
    "FirstToken",
    "MIGRATIONS_DIR",
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
