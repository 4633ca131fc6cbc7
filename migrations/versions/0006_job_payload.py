"""job payload: an accepted job keeps its task payload until it ends (the reconciler's
source when Redis loses its message), and the partial index of unended jobs

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_UNENDED = sa.text("finished_at IS NULL")


def upgrade() -> None:
    # Jobs accepted before this revision have no payload: if their message is lost, the
    # reconciler ends them with an error instead of sending them again.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("payload", sa.JSON(), nullable=True))
    op.create_index("ix_jobs_unended", "jobs", ["enqueued_at"], sqlite_where=_UNENDED,
                    postgresql_where=_UNENDED)


def downgrade() -> None:
    op.drop_index("ix_jobs_unended", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("payload")
