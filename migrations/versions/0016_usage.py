"""the usage ledger (tokens and ended jobs per tenant, lane and day) and a tenant's monthly
token budget

The ledger starts empty: jobs that ended before this revision are in their rows only (a
backfill would have to run while workers end jobs, and count none twice).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens")
JOBS = ("jobs_done", "jobs_error", "jobs_cancelled", "jobs_expired")


def upgrade() -> None:
    op.create_table(
        "usage",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("lane", sa.String(64), nullable=False),
        *(sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)
          for name in COUNTS),
        *(sa.Column(name, sa.Integer(), server_default="0", nullable=False) for name in JOBS),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name="fk_usage_tenant_id_tenants"),
        sa.PrimaryKeyConstraint("tenant_id", "day", "lane", name="pk_usage"),
    )
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("monthly_token_budget", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("monthly_token_budget")
    op.drop_table("usage")
