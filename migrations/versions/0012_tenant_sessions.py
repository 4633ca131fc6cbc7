"""sessions keyed by tenant and id; tenants' highest priority

A session id was global: a tenant could take an id another tenant's producer would use
next (their turns then got 403, and the 403 told anyone the id existed). The primary key
becomes (tenant_id, id): another tenant's use of an id is another session. The index on
tenant_id alone goes: the key starts with it.

tenants.max_priority: the highest public priority (0-9, 9 most urgent) the tenant's jobs
may ask; NULL (every tenant here before) caps them at each lane's default priority.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("max_priority", sa.Integer(), nullable=True))
    _key_sessions(["tenant_id", "id"])
    op.drop_index(op.f("ix_sessions_tenant_id"), table_name="sessions")


def downgrade() -> None:
    # Two tenants' sessions of one id cannot both stay under a key of the id alone: the
    # oldest keeps it.
    op.execute("DELETE FROM sessions WHERE EXISTS (SELECT 1 FROM sessions AS older "
               "WHERE older.id = sessions.id AND (older.last_seen < sessions.last_seen "
               "OR (older.last_seen = sessions.last_seen "
               "AND older.tenant_id < sessions.tenant_id)))")
    op.create_index(op.f("ix_sessions_tenant_id"), "sessions", ["tenant_id"])
    _key_sessions(["id"])
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("max_priority")


def _key_sessions(columns: list[str]) -> None:
    """The sessions table's primary key on `columns`. SQLite cannot alter a key: batch mode
    copies the table (PostgreSQL alters it in place)."""
    with op.batch_alter_table("sessions", recreate="auto") as batch:
        batch.drop_constraint("pk_sessions", type_="primary")
        batch.create_primary_key("pk_sessions", columns)
