"""routing decision and LoRA on jobs; per-tenant rate limits

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("lora", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("route_reason", sa.Text(), nullable=True))
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("requests_per_minute", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tokens_per_minute", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("tokens_per_minute")
        batch.drop_column("requests_per_minute")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("route_reason")
        batch.drop_column("lora")
