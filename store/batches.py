"""The Batch API's files and batches in the store (api/batches.py drives them).

A batch's progress is a few counters and a cursor (`submitted`: the input lines handed
to the queue, in order), written after each step. A step repeated after a crash is
harmless: each line's job carries the idempotency key `<batch id>:<line>`, so the line
submitted again finds its job.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update

from store.db import Store, utcnow
from store.models import Batch, File, Job, Tenant
from store.records import JobRecord, TenantRecord, job_record, tenant_record

OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
ENDED_STATUSES = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant_id: int
    purpose: str
    filename: str
    bytes: int
    created_at: datetime


@dataclass(frozen=True)
class BatchRecord:
    id: str
    tenant_id: int
    status: str
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


_FILE_FIELDS = [f.name for f in fields(FileRecord)]
_BATCH_FIELDS = [f.name for f in fields(BatchRecord)]


def _file(row: File) -> FileRecord:
    return FileRecord(**{name: getattr(row, name) for name in _FILE_FIELDS})


def _batch(row: Batch) -> BatchRecord:
    values = {name: getattr(row, name) for name in _BATCH_FIELDS}
    values["line_errors"] = list(row.line_errors or [])
    return BatchRecord(**values)


class Batches:
    """Files and batches, on a Store's engine and transactions."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- files ---------------------------------------------------------------------

    def create_file(self, tenant_id: int, purpose: str, filename: str, content: str) -> FileRecord:
        row = File(id=f"file-{secrets.token_hex(12)}", tenant_id=tenant_id, purpose=purpose,
                   filename=filename, bytes=len(content.encode()), content=content,
                   created_at=utcnow())
        with self.store._write() as session:
            session.add(row)
            session.flush()
            return _file(row)

    def get_file(self, file_id: str, tenant_id: int) -> FileRecord | None:
        with self.store._read() as session:
            row = session.get(File, file_id)
            return _file(row) if row is not None and row.tenant_id == tenant_id else None

    def file_content(self, file_id: str, tenant_id: int) -> str | None:
        with self.store._read() as session:
            row = session.get(File, file_id)
            return row.content if row is not None and row.tenant_id == tenant_id else None

    # -- batches -------------------------------------------------------------------

    def create_batch(self, tenant_id: int, endpoint: str, window: timedelta,
                     window_name: str, input_file_id: str, total: int,
                     meta: dict[str, Any] | None) -> BatchRecord:
        now = utcnow()
        row = Batch(id=f"batch_{secrets.token_hex(12)}", tenant_id=tenant_id,
                    status="validating", endpoint=endpoint, completion_window=window_name,
                    input_file_id=input_file_id, total=total, submitted=0, completed=0,
                    failed=0, line_errors=[], meta=meta, created_at=now,
                    expires_at=now + window)
        with self.store._write() as session:
            session.add(row)
            session.flush()
            return _batch(row)

    def get_batch(self, batch_id: str, tenant_id: int | None = None) -> BatchRecord | None:
        with self.store._read() as session:
            row = session.get(Batch, batch_id)
            if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
                return None
            return _batch(row)

    def list_batches(self, tenant_id: int, after: str | None, limit: int) -> list[BatchRecord]:
        """The tenant's batches, newest first; `after`: the last id of the page before."""
        stmt = select(Batch).where(Batch.tenant_id == tenant_id)
        if after is not None:
            with self.store._read() as session:
                mark = session.get(Batch, after)
            if mark is not None:
                stmt = stmt.where((Batch.created_at < mark.created_at)
                                  | ((Batch.created_at == mark.created_at) & (Batch.id < after)))
        stmt = stmt.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)
        with self.store._read() as session:
            return [_batch(row) for row in session.scalars(stmt)]

    def open_batches(self) -> list[BatchRecord]:
        stmt = select(Batch).where(Batch.status.in_(OPEN_STATUSES)).order_by(Batch.created_at)
        with self.store._read() as session:
            return [_batch(row) for row in session.scalars(stmt)]

    def update_batch(self, batch_id: str, expect: tuple[str, ...] | None = None,
                     **values: Any) -> BatchRecord | None:
        """Write `values`; with `expect`, only while the batch's status is one of them (a
        cancel and the driver race on it). None when nothing was written."""
        stmt = update(Batch).where(Batch.id == batch_id)
        if expect is not None:
            stmt = stmt.where(Batch.status.in_(expect))
        with self.store._write() as session:
            if session.execute(stmt.values(**values)).rowcount == 0:  # type: ignore[attr-defined]
                return None
            row = session.get(Batch, batch_id)
            return _batch(row) if row is not None else None

    def line_jobs(self, tenant_id: int, batch_id: str, lines: int) -> dict[int, JobRecord]:
        """The jobs of the batch's first `lines` lines, by line number."""
        prefix = f"{batch_id}:"
        wanted = [f"{prefix}{i}" for i in range(lines)]
        found: dict[int, JobRecord] = {}
        with self.store._read() as session:
            for start in range(0, len(wanted), 500):  # bound the IN list
                stmt = select(Job).where(Job.tenant_id == tenant_id,
                                         Job.idempotency_key.in_(wanted[start:start + 500]))
                for job in session.scalars(stmt):
                    found[int((job.idempotency_key or "").removeprefix(prefix))] = job_record(job)
        return found

    def tenant(self, tenant_id: int) -> TenantRecord | None:
        with self.store._read() as session:
            row = session.get(Tenant, tenant_id)
            return tenant_record(row) if row is not None and row.revoked_at is None else None
