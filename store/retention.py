"""What the retention purge removes from the store (scheduler/retention.py decides when):
ended jobs' output text, and files past their expiry.

Each statement works on at most `BATCH` rows per transaction, so a purge of a long
backlog never holds the write lock (SQLite) or many row locks (PostgreSQL) for long, and
never reads a large result. Job rows themselves stay: their status, usage and timings are
the accounting.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, Select, and_, delete, not_, or_, select, update

from store.database import Database
from store.models import Batch, File, FilePart, Job, WebhookDelivery
from store.webhooks import WAITING_STATUSES
from tidegate.records import OPEN_BATCH_STATUSES

BATCH = 500  # rows per transaction


class Retention:
    def __init__(self, db: Database) -> None:
        self.db = db

    def purge_job_text(self, cutoff: datetime) -> int:
        """Clears the output text (and any payload left: the prompt) of jobs that ended
        before `cutoff`; their rows, status and usage stay. Kept until they are used: the
        jobs of a batch not ended (its output file is written from them) and of a webhook
        not delivered yet (its body is read from the row when it is sent)."""
        purged = 0
        while True:
            with self.db.write() as session:
                ids = list(session.scalars(self._text_due(cutoff)))
                if ids:
                    session.execute(update(Job).where(Job.id.in_(ids))
                                    .values(output_text=None, payload=None))
            purged += len(ids)
            if len(ids) < BATCH:
                return purged

    def _text_due(self, cutoff: datetime) -> Select[str]:
        # The partial index ix_jobs_text_kept holds exactly the jobs with text.
        stmt = (select(Job.id)
                .where(Job.output_text.is_not(None), Job.finished_at <= cutoff,
                       # job_id IS NOT NULL: a batch's delivery has none, and one NULL
                       # in a NOT IN list makes it match no row at all.
                       Job.id.not_in(select(WebhookDelivery.job_id).where(
                           WebhookDelivery.status.in_(WAITING_STATUSES),
                           WebhookDelivery.job_id.is_not(None))))
                .order_by(Job.finished_at).limit(BATCH))
        for tenant_id, batch_id in self._open_batches():
            stmt = stmt.where(_not_of_batch(tenant_id, batch_id))
        return stmt

    def _open_batches(self) -> list[tuple[int, str]]:
        with self.db.read() as session:
            rows = session.execute(select(Batch.tenant_id, Batch.id)
                                   .where(Batch.status.in_(OPEN_BATCH_STATUSES)))
            return [(row.tenant_id, row.id) for row in rows]

    def purge_files(self, now: datetime, input_cutoff: datetime,
                    output_cutoff: datetime) -> int:
        """Deletes the files past their `expires_at`, except the input of a batch not
        ended (it goes at the first purge after the batch's end). Rows from before
        migration 0013 have no `expires_at`: theirs counts from `created_at`, the upload
        to `input_cutoff`, a batch's output to `output_cutoff`."""
        open_inputs = select(Batch.input_file_id).where(Batch.status.in_(OPEN_BATCH_STATUSES))
        due = or_(File.expires_at <= now,
                  and_(File.expires_at.is_(None), File.purpose == "batch",
                       File.created_at <= input_cutoff),
                  and_(File.expires_at.is_(None), File.purpose != "batch",
                       File.created_at <= output_cutoff))
        stmt = select(File.id).where(due, File.id.not_in(open_inputs)).limit(BATCH)
        purged = 0
        while True:
            with self.db.write() as session:
                ids = list(session.scalars(stmt))
                if ids:
                    session.execute(delete(FilePart).where(FilePart.file_id.in_(ids)))
                    session.execute(delete(File).where(File.id.in_(ids)))
            purged += len(ids)
            if len(ids) < BATCH:
                return purged


def _not_of_batch(tenant_id: int, batch_id: str) -> ColumnElement[bool]:
    """Not one of the batch's line jobs (idempotency key `<batch id>:<line>`)."""
    return or_(Job.tenant_id != tenant_id, Job.idempotency_key.is_(None),
               not_(Job.idempotency_key.startswith(f"{batch_id}:", autoescape=True)))
