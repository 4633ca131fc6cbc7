"""traffic: arrivals per lane per minute, the forecaster's history

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "traffic",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("lane", sa.String(length=64), nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("arrivals", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_traffic")),
        sa.UniqueConstraint("lane", "minute", name=op.f("uq_traffic_lane_minute")),
    )


def downgrade() -> None:
    op.drop_table("traffic")
