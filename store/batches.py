"""The Batch API's files and batches in the store (api/batches.py drives them).

A batch's progress is a few counters and a cursor (`submitted`: the input lines handed
to the queue, in order), written after each step. A step repeated after a crash is
harmless: each line's job carries the idempotency key `<batch id>:<line>`, so the line
submitted again finds its job.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from store.clock import utcnow
from store.database import Database
from store.models import Batch, File, FilePart, Job, Tenant, WebhookDelivery
from store.records import JobRecord, TenantRecord, job_record, tenant_record
from tidegate.records import (
    ENDED_BATCH_STATUSES,
    OPEN_BATCH_STATUSES,
    BatchStatus,
    DeliveryStatus,
)

# A batch's end, as the event its tenant's webhook is sent (OpenAI's names).
BATCH_EVENTS = {status: f"batch.{status}" for status in ENDED_BATCH_STATUSES}
# Every file id this store hands out; anything else is no file, answered without a query
# (PostgreSQL refuses a NUL in a string parameter with an error, not an empty result).
FILE_ID = re.compile(r"file-[0-9a-f]{24}")
# A file's text is stored in parts of this many characters (file_parts), written in order
# and read one at a time: serving a file never holds it whole (a part is at most 1 MiB of
# UTF-8, and as a Python string at most 1 MiB too: 4 bytes a character at worst).
PART_CHARS = 256 * 1024


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant_id: int
    purpose: str
    filename: str
    bytes: int
    created_at: datetime
    expires_at: datetime | None  # when the purge deletes it (None: rows before 0013)


@dataclass(frozen=True)
class FileQuota:
    """What one tenant may store: files, and their bytes (outputs included)."""

    files: int
    bytes: int


@dataclass(frozen=True)
class Deletion:
    """What a delete did: `found` the tenant's file; `in_use_by` the open batch whose
    input it is, when it was kept for that batch."""

    found: bool
    in_use_by: str | None = None


@dataclass(frozen=True)
class BatchRecord:
    id: str
    tenant_id: int
    status: BatchStatus
    endpoint: str
    completion_window: str
    input_file_id: str
    output_file_id: str | None
    error_file_id: str | None
    total: int
    submitted: int
    completed: int
    failed: int
    line_errors: list[Any]
    errors: list[Any] | None
    meta: dict[str, Any] | None
    created_at: datetime
    expires_at: datetime
    in_progress_at: datetime | None
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None
    output_expires_after_s: int | None = None  # its output files' lifetime (api/files.py)
    model: str | None = None  # the model its lines named (the first line submitted)
    usage: dict[str, Any] | None = None  # its completed lines' tokens (OpenAI's `usage`)


_FILE_FIELDS = [f.name for f in fields(FileRecord)]
_BATCH_FIELDS = [f.name for f in fields(BatchRecord)]


def _file(row: File) -> FileRecord:
    return FileRecord(**{name: getattr(row, name) for name in _FILE_FIELDS})


def _batch(row: Batch) -> BatchRecord:
    values = {name: getattr(row, name) for name in _BATCH_FIELDS}
    values["line_errors"] = list(row.line_errors or [])
    values["status"] = BatchStatus(row.status)
    return BatchRecord(**values)


class Batches:
    """Files and batches, on a Store's engine and transactions."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # -- files ---------------------------------------------------------------------

    def create_file(self, tenant_id: int, purpose: str, filename: str, content: str,
                    expires_after_s: float | None = None) -> FileRecord:
        """A file written by the system (a batch's output): never refused by a quota."""
        with self.db.write() as session:
            return self._add_file(session, tenant_id, purpose, filename, content,
                                  len(content.encode()), expires_after_s)

    def upload_file(self, tenant_id: int, purpose: str, filename: str, content: str,
                    size: int, expires_after_s: float, quota: FileQuota) -> FileRecord | str:
        """A tenant's upload (`size`: its UTF-8 bytes), or the name of the quota it would
        pass ("files", "bytes"). The count and the insert share one transaction under the
        tenant's row lock (PostgreSQL; SQLite's write lock), so concurrent uploads cannot
        pass a quota together."""
        with self.db.write() as session:
            session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
            count, stored = session.execute(
                select(func.count(), func.coalesce(func.sum(File.bytes), 0))
                .where(File.tenant_id == tenant_id)).one()
            if count + 1 > quota.files:
                return "files"
            if stored + size > quota.bytes:
                return "bytes"
            return self._add_file(session, tenant_id, purpose, filename, content, size,
                                  expires_after_s)

    def _add_file(self, session: Session, tenant_id: int, purpose: str, filename: str,
                  content: str, size: int, expires_after_s: float | None) -> FileRecord:
        now = utcnow()
        expires = now + timedelta(seconds=expires_after_s) if expires_after_s is not None else None
        row = File(id=f"file-{secrets.token_hex(12)}", tenant_id=tenant_id, purpose=purpose,
                   filename=filename, bytes=size, created_at=now, expires_at=expires)
        session.add(row)
        session.flush()
        for seq, start in enumerate(range(0, max(len(content), 1), PART_CHARS)):
            session.execute(insert(FilePart).values(file_id=row.id, seq=seq,
                                                    text=content[start:start + PART_CHARS]))
        return _file(row)

    def get_file(self, file_id: str, tenant_id: int) -> FileRecord | None:
        if not FILE_ID.fullmatch(file_id):
            return None
        with self.db.read() as session:
            row = session.get(File, file_id)
            return _file(row) if row is not None and row.tenant_id == tenant_id else None

    def file_content(self, file_id: str, tenant_id: int) -> str | None:
        """The whole text, read in one transaction (the batch driver parses it); to serve
        a file, `file_parts`."""
        if not FILE_ID.fullmatch(file_id):
            return None
        with self.db.read() as session:
            row = session.get(File, file_id)
            if row is None or row.tenant_id != tenant_id:
                return None
            return "".join(session.scalars(select(FilePart.text)
                                           .where(FilePart.file_id == file_id)
                                           .order_by(FilePart.seq)))

    def file_parts(self, file_id: str) -> Iterator[str]:
        """The file's text a part at a time, each read in a short transaction of its own
        (no connection is held between two). Ends early if the file is deleted meanwhile:
        a response then ends short of its Content-Length, and the client sees it cut."""
        seq = 0
        while True:
            with self.db.read() as session:
                text = session.scalar(select(FilePart.text).where(FilePart.file_id == file_id,
                                                                  FilePart.seq == seq))
            if text is None:
                return
            yield text
            seq += 1

    def delete_file(self, file_id: str, tenant_id: int) -> Deletion:
        """Deletes the tenant's file, unless it is the input of an open batch (the batch
        reads it until it ends): the file's row is locked first, so a batch's end and a
        purge never see it half gone."""
        if not FILE_ID.fullmatch(file_id):
            return Deletion(found=False)
        with self.db.write() as session:
            row = session.execute(select(File.tenant_id).where(File.id == file_id)
                                  .with_for_update()).first()
            if row is None or row.tenant_id != tenant_id:
                return Deletion(found=False)
            user = session.scalar(select(Batch.id).where(Batch.input_file_id == file_id,
                                                         Batch.status.in_(OPEN_BATCH_STATUSES))
                                  .limit(1))
            if user is not None:
                return Deletion(found=True, in_use_by=user)
            session.execute(delete(FilePart).where(FilePart.file_id == file_id))
            session.execute(delete(File).where(File.id == file_id))
            return Deletion(found=True)

    def list_files(self, tenant_id: int, purpose: str | None, after: str | None, limit: int,
                   newest_first: bool = True) -> list[FileRecord] | None:
        """A page of the tenant's files (OpenAI's order: by creation); `after`: the last id
        of the page before. None when `after` is not one of the tenant's files."""
        stmt = select(File).where(File.tenant_id == tenant_id)
        if purpose is not None:
            stmt = stmt.where(File.purpose == purpose)
        with self.db.read() as session:
            if after is not None:
                mark = session.get(File, after) if FILE_ID.fullmatch(after) else None
                if mark is None or mark.tenant_id != tenant_id:  # never another's place
                    return None
                if newest_first:
                    stmt = stmt.where((File.created_at < mark.created_at)
                                      | ((File.created_at == mark.created_at) & (File.id < after)))
                else:
                    stmt = stmt.where((File.created_at > mark.created_at)
                                      | ((File.created_at == mark.created_at) & (File.id > after)))
            order = ((File.created_at.desc(), File.id.desc()) if newest_first
                     else (File.created_at, File.id))
            return [_file(row) for row in session.scalars(stmt.order_by(*order).limit(limit))]

    def open_batch_count(self, tenant_id: int) -> int:
        """The tenant's batches not ended (TIDEGATE_TENANT_MAX_OPEN_BATCHES bounds them)."""
        with self.db.read() as session:
            return int(session.scalar(select(func.count()).select_from(Batch).where(
                Batch.tenant_id == tenant_id, Batch.status.in_(OPEN_BATCH_STATUSES))) or 0)

    # -- batches -------------------------------------------------------------------

    def create_batch(self, tenant_id: int, endpoint: str, window: timedelta,
                     window_name: str, input_file_id: str, total: int,
                     meta: dict[str, Any] | None,
                     output_expires_after_s: int | None = None) -> BatchRecord:
        now = utcnow()
        row = Batch(id=f"batch_{secrets.token_hex(12)}", tenant_id=tenant_id,
                    status=BatchStatus.VALIDATING, endpoint=endpoint, completion_window=window_name,
                    input_file_id=input_file_id, total=total, submitted=0, completed=0,
                    failed=0, line_errors=[], meta=meta, created_at=now,
                    expires_at=now + window, output_expires_after_s=output_expires_after_s)
        with self.db.write() as session:
            session.add(row)
            session.flush()
            return _batch(row)

    def get_batch(self, batch_id: str, tenant_id: int | None = None) -> BatchRecord | None:
        with self.db.read() as session:
            row = session.get(Batch, batch_id)
            if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
                return None
            return _batch(row)

    def list_batches(self, tenant_id: int, after: str | None, limit: int) -> list[BatchRecord]:
        """The tenant's batches, newest first; `after`: the last id of the page before."""
        stmt = select(Batch).where(Batch.tenant_id == tenant_id)
        if after is not None:
            with self.db.read() as session:
                mark = session.get(Batch, after)
            if mark is not None and mark.tenant_id == tenant_id:  # never another's place
                stmt = stmt.where((Batch.created_at < mark.created_at)
                                  | ((Batch.created_at == mark.created_at) & (Batch.id < after)))
        stmt = stmt.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)
        with self.db.read() as session:
            return [_batch(row) for row in session.scalars(stmt)]

    def open_batches(self) -> list[BatchRecord]:
        stmt = select(Batch).where(Batch.status.in_(OPEN_BATCH_STATUSES)).order_by(Batch.created_at)
        with self.db.read() as session:
            return [_batch(row) for row in session.scalars(stmt)]

    def update_batch(self, batch_id: str, expect: tuple[BatchStatus, ...] | None = None,
                     **values: object) -> BatchRecord | None:
        """Write `values`; with `expect`, only while the batch's status is one of them (a
        cancel and the driver race on it). None when nothing was written."""
        stmt = update(Batch).where(Batch.id == batch_id)
        if expect is not None:
            stmt = stmt.where(Batch.status.in_(expect))
        with self.db.write() as session:
            if session.execute(stmt.values(**values)).rowcount == 0:  # type: ignore[attr-defined]
                return None
            row = session.get(Batch, batch_id)
            return _batch(row) if row is not None else None

    def end_batch(self, batch_id: str, status: BatchStatus, **values: object) -> BatchRecord | None:
        """The batch's end (`status`, one of ENDED_BATCH_STATUSES), written once: its webhook
        (`batch.<status>`, to the tenant's webhook URL, if it has one) goes into the outbox
        in the same transaction, so an ended batch's webhook is never lost nor sent twice
        (tasks/webhooks.py sends it). None when the batch had ended already."""
        now = utcnow()
        with self.db.write() as session:
            done = session.execute(update(Batch).where(Batch.id == batch_id,
                                                       Batch.status.in_(OPEN_BATCH_STATUSES))
                                   .values(status=status, **values))
            if done.rowcount == 0:  # type: ignore[attr-defined]
                return None
            row = session.get(Batch, batch_id)
            assert row is not None
            url = session.scalar(select(Tenant.webhook_url).where(  # none to a revoked one
                Tenant.id == row.tenant_id, Tenant.revoked_at.is_(None)))
            if url:
                session.add(WebhookDelivery(
                    id=f"msg_{secrets.token_hex(12)}", job_id=None, event=BATCH_EVENTS[status],
                    batch_id=batch_id, tenant_id=row.tenant_id, url=url,
                    status=DeliveryStatus.PENDING,
                    attempts=0, next_attempt_at=now, created_at=now))
            session.flush()
            return _batch(row)

    def line_jobs(self, tenant_id: int, batch_id: str, lines: int) -> dict[int, JobRecord]:
        """The jobs of the batch's first `lines` lines, by line number."""
        prefix = f"{batch_id}:"
        wanted = [f"{prefix}{i}" for i in range(lines)]
        found: dict[int, JobRecord] = {}
        with self.db.read() as session:
            for start in range(0, len(wanted), 500):  # bound the IN list
                stmt = select(Job).where(Job.tenant_id == tenant_id,
                                         Job.idempotency_key.in_(wanted[start:start + 500]))
                for job in session.scalars(stmt):
                    found[int((job.idempotency_key or "").removeprefix(prefix))] = job_record(job)
        return found

    def tenant(self, tenant_id: int) -> TenantRecord | None:
        with self.db.read() as session:
            row = session.get(Tenant, tenant_id)
            return tenant_record(row) if row is not None and row.revoked_at is None else None
