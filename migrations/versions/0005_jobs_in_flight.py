"""jobs in flight per tenant: an index for the API's per-tenant cap

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(op.f("ix_jobs_tenant_id_status"), "jobs", ["tenant_id", "status"])


def downgrade() -> None:
    op.drop_index(op.f("ix_jobs_tenant_id_status"), table_name="jobs")
