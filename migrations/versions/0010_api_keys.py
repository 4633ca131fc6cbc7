"""api keys of their own: several named keys per tenant, and admin keys; each tenant's
first key moves from tenants.key_hash to api_keys (named `default`)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

AT = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("created_at", AT, nullable=False),
        sa.Column("last_used_at", AT, nullable=True),
        sa.Column("expires_at", AT, nullable=True),
        sa.Column("revoked_at", AT, nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_api_keys_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])
    op.create_index(op.f("ix_api_keys_key_hash"), "api_keys", ["key_hash"], unique=True)
    op.create_table(
        "admin_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("created_at", AT, nullable=False),
        sa.Column("revoked_at", AT, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admin_keys")),
    )
    op.create_index(op.f("ix_admin_keys_key_hash"), "admin_keys", ["key_hash"], unique=True)
    op.execute("INSERT INTO api_keys (tenant_id, name, key_hash, created_at, revoked_at) "
               "SELECT id, 'default', key_hash, created_at, revoked_at FROM tenants "
               "WHERE key_hash IS NOT NULL")
    with op.batch_alter_table("tenants") as batch:
        batch.alter_column("key_hash", existing_type=sa.String(64), nullable=True)


def downgrade() -> None:
    op.drop_table("admin_keys")
    op.drop_table("api_keys")
