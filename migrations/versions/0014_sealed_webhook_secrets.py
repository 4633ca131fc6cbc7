"""sealed webhook secrets: a secret is stored as a Fernet token of the server's key
(tidegate/sealing.py), longer than the plain `whsec_...` it replaces

Secrets stored before stay plain until `tidegate webhooks` starts and seals them with its
key (store/webhooks.py `seal_plain`): a migration does not hold the key.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("webhook_secrets") as batch:
        batch.alter_column("secret", type_=sa.String(512), existing_type=sa.String(128),
                           existing_nullable=False)


def downgrade() -> None:
    # A sealed secret does not fit the old column: a downgrade keeps the plain ones only.
    op.execute(sa.text("DELETE FROM webhook_secrets WHERE secret NOT LIKE 'whsec\\_%' "
                       "ESCAPE '\\'"))
    with op.batch_alter_table("webhook_secrets") as batch:
        batch.alter_column("secret", type_=sa.String(128), existing_type=sa.String(512),
                           existing_nullable=False)
