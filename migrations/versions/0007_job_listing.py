"""a tenant's jobs in acceptance order: an index for GET /v1/jobs

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(op.f("ix_jobs_tenant_id_enqueued_at_id"), "jobs",
                    ["tenant_id", "enqueued_at", "id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_jobs_tenant_id_enqueued_at_id"), table_name="jobs")
