"""batches as OpenAI files them: a batch's `model` and `usage`, and batch webhooks
(`batch.completed`, `batch.expired`, `batch.cancelled`, `batch.failed`) in the outbox

A delivery now names its event: NULL (every row before this revision) is a job's end,
`job.ended`, with its `job_id`; a batch event carries its `batch_id` and no job.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("model", sa.String(256), nullable=True))
        batch.add_column(sa.Column("usage", sa.JSON(none_as_null=True), nullable=True))
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.add_column(sa.Column("event", sa.String(32), nullable=True))
        batch.add_column(sa.Column("batch_id", sa.String(64), nullable=True))
        batch.alter_column("job_id", existing_type=sa.String(36), nullable=True)


def downgrade() -> None:
    # A batch event has no job: it goes with the columns that describe it.
    op.execute(sa.text("DELETE FROM webhook_attempts WHERE delivery_id IN "
                       "(SELECT id FROM webhook_deliveries WHERE job_id IS NULL)"))
    op.execute(sa.text("DELETE FROM webhook_deliveries WHERE job_id IS NULL"))
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.alter_column("job_id", existing_type=sa.String(36), nullable=False)
        batch.drop_column("batch_id")
        batch.drop_column("event")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("usage")
        batch.drop_column("model")
