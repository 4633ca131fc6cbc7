"""retention and bounded files: a file's text in parts, files expire, a batch's output
files expire after its output_expires_after, and an index for the purge of ended jobs'
output text (scheduler/retention.py)

A file's text moves from `files.content` to `file_parts`, one slice of PART_CHARS
characters a row, so a file is served a part at a time and never loaded whole. Files
uploaded before keep no `expires_at`: the purge counts their retention from created_at.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PART_CHARS = 256 * 1024  # store/batches.py's, as of this revision
_TEXT_KEPT = sa.text("output_text IS NOT NULL")
_FILES = sa.table("files", sa.column("id", sa.String), sa.column("content", sa.Text))
_PARTS = sa.table("file_parts", sa.column("file_id", sa.String),
                  sa.column("seq", sa.Integer), sa.column("text", sa.Text))


def upgrade() -> None:
    op.create_table(
        "file_parts",
        sa.Column("file_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"],
                                name=op.f("fk_file_parts_file_id_files")),
        sa.PrimaryKeyConstraint("file_id", "seq", name=op.f("pk_file_parts")),
    )
    _split_contents()
    with op.batch_alter_table("files") as batch:
        batch.drop_column("content")
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_index(batch.f("ix_files_expires_at"), ["expires_at"])
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("output_expires_after_s", sa.Integer(), nullable=True))
    op.create_index("ix_jobs_text_kept", "jobs", ["finished_at"], sqlite_where=_TEXT_KEPT,
                    postgresql_where=_TEXT_KEPT)


def _split_contents() -> None:
    """Each file's text into parts, one file at a time (a file is at most the API's limit)."""
    conn = op.get_bind()
    for file_id in list(conn.scalars(sa.select(_FILES.c.id))):
        text = conn.scalar(sa.select(_FILES.c.content).where(_FILES.c.id == file_id)) or ""
        parts = [{"file_id": file_id, "seq": seq, "text": text[start:start + PART_CHARS]}
                 for seq, start in enumerate(range(0, max(len(text), 1), PART_CHARS))]
        conn.execute(_PARTS.insert(), parts)


def downgrade() -> None:
    op.drop_index("ix_jobs_text_kept", table_name="jobs")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("output_expires_after_s")
    with op.batch_alter_table("files") as batch:
        batch.drop_index(batch.f("ix_files_expires_at"))
        batch.drop_column("expires_at")
        batch.add_column(sa.Column("content", sa.Text(), nullable=True))
    conn = op.get_bind()
    for file_id in list(conn.scalars(sa.select(_FILES.c.id))):
        parts = conn.scalars(sa.select(_PARTS.c.text).where(_PARTS.c.file_id == file_id)
                             .order_by(_PARTS.c.seq))
        conn.execute(_FILES.update().where(_FILES.c.id == file_id)
                     .values(content="".join(parts)))
    with op.batch_alter_table("files") as batch:
        batch.alter_column("content", existing_type=sa.Text(), nullable=False)
    op.drop_table("file_parts")
