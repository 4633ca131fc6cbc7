"""A job's run: its claim by a worker, its first token and its end (or its cancel or
expiry), each written so that racing writers agree.

Job state changes that can race (claim, first token, end, cancel) are single UPDATEs
guarded by the current status, or run under a row lock (PostgreSQL) / the database write
lock (SQLite). On PostgreSQL the claim, the first token and the usual end are single
statements run in autocommit on the driver itself (store/hot.py). Every end writes the
usage ledger (store/usage.py) and the job's webhook (the outbox) in its own transaction.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, TypedDict, cast

from sqlalchemy import (
    ColumnElement,
    Connection,
    Table,
    bindparam,
    func,
    insert,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import ReturningUpdate

from store.clock import aware, ms_between, utcnow
from store.database import Database
from store.jobs import BY_ID, JOB_COLUMNS, JOBS, SELECT_JOB
from store.models import Job, UTCDateTime, WebhookDelivery
from store.records import JobRecord, job_record, row_job_record
from store.usage import meter, metered_end
from tidegate.records import ACTIVE_STATUSES, TERMINAL_STATUSES, DeliveryStatus, JobStatus

# Jobs stopped from outside while a worker may still be generating: the worker's end
# fills in usage and output but does not change the status.
_STOPPED = frozenset({JobStatus.CANCELLED, JobStatus.EXPIRED})


class FirstTokenValues(TypedDict):
    """A first token's columns, as end_job's parameters name them."""

    first_at: datetime | None
    ttft: float | None  # ms from the row's started_at
    cached: int | None  # prompt tokens found in the engine's prefix cache


@dataclass(frozen=True)
class FirstToken:
    """A job's first token, not yet in its row: written with the job's end (end_job)."""

    at: datetime
    started_at: datetime | None  # the row's, from the claim: the TTFT's start
    cached_tokens: int | None = None

    def values(self) -> FirstTokenValues:
        at = aware(self.at)
        return {"first_at": at, "ttft": ms_between(self.started_at, at),
                "cached": self.cached_tokens}


_NO_FIRST_TOKEN: FirstTokenValues = {"first_at": None, "ttft": None, "cached": None}


class OutboxRow(TypedDict):
    """A job's webhook delivery, written with its end (tasks/webhooks.py sends it)."""

    id: str
    job_id: str
    tenant_id: int
    url: str
    status: DeliveryStatus
    attempts: int
    next_attempt_at: datetime
    created_at: datetime


_WEBHOOK_DELIVERIES = cast(Table, WebhookDelivery.__table__)
_SELECT_ENQUEUED_AT = select(JOBS.c.enqueued_at).where(BY_ID)
_SELECT_STARTED_AT = select(JOBS.c.started_at).where(BY_ID)
# The statuses a worker may move a job on from, written out (no expanding IN list: the
# statements run as compiled once, store/hot.py).
_ACTIVE = JOBS.c.status.in_([literal_column(f"'{status}'") for status in
                             sorted(ACTIVE_STATUSES)])
_NOW = bindparam("now", type_=UTCDateTime())


def _claim(wait_ms: ColumnElement[Any]) -> ReturningUpdate[Any]:
    return (
        update(JOBS)
        .where(BY_ID, _ACTIVE)
        .values(
            status=JobStatus.RUNNING,
            started_at=func.coalesce(JOBS.c.started_at, _NOW),
            queue_wait_ms=func.coalesce(JOBS.c.queue_wait_ms, wait_ms),
            worker=bindparam("by_worker"),
            engine=bindparam("by_engine"),
            attempts=JOBS.c.attempts + 1,
        )
        .returning(*JOB_COLUMNS)
    )


_CLAIM = _claim(bindparam("wait_ms"))
# PostgreSQL: the wait from the row's enqueued_at, in the same UPDATE (no SELECT first).
_CLAIM_AT_ONCE = _claim(func.extract("epoch", _NOW - JOBS.c.enqueued_at) * 1000)
_FIRST_TOKEN = (
    update(JOBS)
    .where(BY_ID, JOBS.c.first_token_at.is_(None))
    .values(first_token_at=bindparam("at", type_=UTCDateTime()), ttft_ms=bindparam("ttft"),
            cached_tokens=bindparam("cached"))
)


def _given(name: str, column: ColumnElement[Any]) -> ColumnElement[Any]:
    """The parameter `name` where given, else the column's value."""
    return func.coalesce(bindparam(name, type_=column.type), column)


_END_RUNNING = (
    update(JOBS)
    .where(BY_ID, _ACTIVE)
    .values(
        status=bindparam("to_status"),
        finished_at=bindparam("finished_at", type_=UTCDateTime()),
        finish_reason=_given("finish_reason", JOBS.c.finish_reason),
        output_text=_given("output_text", JOBS.c.output_text),
        completion_tokens=_given("completion_tokens", JOBS.c.completion_tokens),
        error=_given("error", JOBS.c.error),
        tpot_ms=_given("tpot", JOBS.c.tpot_ms),
        payload=null(),
        # A first token the worker did not write before (it came with the end): the row's
        # own, where it has one, is kept (mark_first_token: only the first counts).
        first_token_at=func.coalesce(JOBS.c.first_token_at,
                                     bindparam("first_at", type_=UTCDateTime())),
        ttft_ms=func.coalesce(JOBS.c.ttft_ms, bindparam("ttft", type_=JOBS.c.ttft_ms.type)),
        cached_tokens=func.coalesce(JOBS.c.cached_tokens,
                                    bindparam("cached", type_=JOBS.c.cached_tokens.type)),
    )
    .returning(*JOB_COLUMNS)
)
# The usual end, of a job with no webhook to put in the outbox with it: one statement,
# with its usage ledger row (PostgreSQL: a data-modifying CTE, store/usage.py).
_END_RUNNING_ALONE = metered_end(_END_RUNNING.where(JOBS.c.callback_url.is_(None)))


class Runs:
    def __init__(self, db: Database) -> None:
        self.db = db

    def claim_job(self, job_id: str, worker: str, engine: str) -> JobRecord | None:
        """Move a queued job (or a running one, redelivered after a worker death) to running.

        One guarded UPDATE, so concurrent deliveries serialize on the row and each sees
        the attempts count of the one before. started_at and queue_wait_ms are set by the
        first claim only. None, and nothing changed, when the job is terminal or unknown.
        """
        now = utcnow()
        params = {"job_id": job_id, "now": now, "by_worker": worker, "by_engine": engine}
        if self.db.hot is not None:
            rows = self.db.hot.rows(_CLAIM_AT_ONCE, params)
            return row_job_record(rows[0]) if rows else None
        with self.db.write_conn() as conn:
            enqueued_at = conn.execute(_SELECT_ENQUEUED_AT, {"job_id": job_id}).scalar()
            if enqueued_at is None:
                return None
            row = conn.execute(_CLAIM, {**params, "wait_ms": ms_between(enqueued_at, now)}
                               ).mappings().one_or_none()
        return row_job_record(row) if row else None

    def mark_first_token(self, job_id: str, at: datetime, cached_tokens: int | None = None,
                         started_at: datetime | None = None) -> bool:
        """Record the first token's time, TTFT (from started_at) and the prompt tokens the
        engine found in its prefix cache; only the first call counts. `started_at`: the
        row's, as the claim returned it (a worker has it), which saves reading it here."""
        at = aware(at)
        if started_at is not None and self.db.hot is not None:
            return self.db.hot.rowcount(_FIRST_TOKEN, {"job_id": job_id, "at": at,
                                                       "ttft": ms_between(started_at, at),
                                                       "cached": cached_tokens}) > 0
        with self.db.write_conn() as conn:
            if started_at is None:
                started_at = conn.execute(_SELECT_STARTED_AT, {"job_id": job_id}).scalar()
            return conn.execute(_FIRST_TOKEN, {"job_id": job_id, "at": at,
                                               "ttft": ms_between(started_at, at),
                                               "cached": cached_tokens}).rowcount > 0

    def end_job(
        self,
        job_id: str,
        status: JobStatus,
        *,
        finish_reason: str | None = None,
        output_text: str | None = None,
        completion_tokens: int | None = None,
        error: str | None = None,
        finished_at: datetime | None = None,
        first_token_at: datetime | None = None,
        first_token: FirstToken | None = None,
    ) -> tuple[bool, JobRecord | None]:
        """Move a queued or running job to a terminal status: (whether this call did, the
        row as it then is; None: unknown job). A worker's `done` event carries the row's
        timings, and reading them here saves a read after.

        A job cancelled or expired meanwhile keeps its status but gets the usage, output
        and times it lacks; any other terminal job is left as it is. The job's payload
        (its prompt) is dropped: the job has ended.

        `first_token_at`: the row's, when the caller wrote it (the worker's attempt that
        marked the first token); `first_token`: one it did not write, which this end writes
        as mark_first_token would (a job whose first token came with its end). The usual
        end, of a job still running, is then one UPDATE; any other goes through a read of
        the locked row.

        Safe to retry: a call whose first try committed but whose reply was lost (the
        connection dropped after COMMIT) finds its own end in the row, the same status at
        the same `finished_at`, and answers (True, row) as the first try would have. Without
        that the retry read "already ended" and a worker told its consumer `cancelled` for a
        job that was done. So a caller that retries passes the same `finished_at` each try
        (workers/runner.py does: its arguments are built once, then retried)."""
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"not a terminal status: {status!r}")
        end = aware(finished_at) if finished_at else utcnow()
        first = first_token.values() if first_token else _NO_FIRST_TOKEN
        if first_token_at is not None or first_token is not None:
            ended = self._end_running(job_id, status, end, first_token_at or first["first_at"],
                                      finish_reason, output_text, completion_tokens, error,
                                      first)
            if ended is not None:
                return True, ended
        values = {
            "finish_reason": finish_reason,
            "output_text": output_text,
            "completion_tokens": completion_tokens,
            "error": error,
            "finished_at": end,
        }
        with self.db.write_conn() as conn:
            found = conn.execute(SELECT_JOB.with_for_update(),
                                 {"job_id": job_id}).mappings().one_or_none()
            if found is None:
                return False, None
            return _end_locked(conn, dict(found), status, end, values, first)

    def _end_running(self, job_id: str, status: JobStatus, end: datetime,
                     first_token_at: datetime | None, finish_reason: str | None,
                     output_text: str | None, completion_tokens: int | None,
                     error: str | None, first: FirstTokenValues) -> JobRecord | None:
        """end_job of a job still queued or running, in one UPDATE; None when it was not."""
        params = {"job_id": job_id, "to_status": status, "finished_at": end,
                  "finish_reason": finish_reason, "output_text": output_text,
                  "completion_tokens": completion_tokens, "error": error,
                  "tpot": _tpot_ms(_aware_or_none(first_token_at), end, completion_tokens),
                  **first}
        if self.db.hot is not None:
            rows = self.db.hot.rows(_END_RUNNING_ALONE, {**params, "day": end.date()})
            if rows:
                return row_job_record(rows[0])
        with self.db.write_conn() as conn:
            row = conn.execute(_END_RUNNING, params).mappings().one_or_none()
            if row is None:
                return None
            meter(conn, None, row)  # a running job had not ended: all its usage is new
            if row["callback_url"]:  # a running job has not ended before: its one webhook
                conn.execute(insert(_WEBHOOK_DELIVERIES).values(
                    **_webhook_outbox_row(job_id, row["tenant_id"], row["callback_url"])))
        return row_job_record(row)

    def cancel_job(self, job_id: str, tenant_id: int | None = None) -> JobRecord | None:
        """Cancel a queued or running job; terminal jobs come back unchanged.

        A running job gets finished_at from its worker's end_job, which still fills in
        what was generated until the worker noticed (or from the reconciler, when that
        worker died). A queued job ends here, and its payload is dropped.
        """
        with self.db.write() as session:
            job = _locked_job(session, job_id)
            if job is None or (tenant_id is not None and job.tenant_id != tenant_id):
                return None
            ends_here = job.status == JobStatus.QUEUED  # a running job's worker ends it
            if ends_here:
                job.finished_at = utcnow()
                job.payload = None
            if job.status in ACTIVE_STATUSES:
                job.status = JobStatus.CANCELLED
            if ends_here:
                _ended(session, job)
            session.flush()
            record = job_record(job)
            if ends_here:
                meter(session.connection(), None, asdict(record))
            return record

    def expire_job(self, job_id: str) -> bool:
        """A queued or running job whose deadline passed becomes expired; True when it did."""
        with self.db.write() as session:
            job = _locked_job(session, job_id)
            if job is None or job.status not in ACTIVE_STATUSES:
                return False
            job.status, job.finished_at, job.payload = JobStatus.EXPIRED, utcnow(), None
            _ended(session, job)
            session.flush()
            meter(session.connection(), None, asdict(job_record(job)))
            return True


def _locked_job(session: Session, job_id: str) -> Job | None:
    # FOR UPDATE serializes with other writers on PostgreSQL; SQLite already holds
    # the database write lock (BEGIN IMMEDIATE) and renders no FOR UPDATE.
    return session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()


def _aware_or_none(at: datetime | None) -> datetime | None:
    return aware(at) if at is not None else None


def _same_end(job: Mapping[str, Any], status: JobStatus, end: datetime) -> bool:
    """Whether the row already holds this end: its status, written at `end`."""
    return bool(job["status"] == status and job["finished_at"] == end)


def _end_locked(conn: Connection, job: dict[str, Any], status: JobStatus, end: datetime,
                values: Mapping[str, object],
                first: FirstTokenValues) -> tuple[bool, JobRecord]:
    """Runs.end_job on the row read locked (`job`, its columns): (whether this call moved
    it to `status`, the row as it then is)."""
    if _same_end(job, status, end):
        return True, row_job_record(job)
    if job["status"] in TERMINAL_STATUSES and job["status"] not in _STOPPED:
        return False, row_job_record(job)
    was_open = job["finished_at"] is None
    active = job["status"] in ACTIVE_STATUSES
    before = dict(job)
    changes: dict[str, object] = {name: value for name, value in values.items()
                                  if value is not None and (active or job[name] is None)}
    if job["first_token_at"] is None and first["first_at"] is not None:
        changes.update(first_token_at=first["first_at"], ttft_ms=first["ttft"],
                       cached_tokens=first["cached"])
    job.update(changes)
    if job["tpot_ms"] is None:
        changes["tpot_ms"] = _tpot_ms(job["first_token_at"], end, job["completion_tokens"])
    changes["payload"] = None
    if active:
        changes["status"] = status
    job.update(changes)
    conn.execute(update(JOBS).where(JOBS.c.id == job["id"]).values(**changes))
    meter(conn, before, job)  # the usage ledger, in the end's transaction (store/usage.py)
    if was_open and job["callback_url"]:
        conn.execute(insert(_WEBHOOK_DELIVERIES).values(
            **_webhook_outbox_row(job["id"], job["tenant_id"], job["callback_url"])))
    return active, row_job_record(job)


def _tpot_ms(
    first_token_at: datetime | None, finished_at: datetime, tokens: int | None
) -> float | None:
    """Time per output token after the first one."""
    span = ms_between(first_token_at, finished_at)
    if span is None or tokens is None or tokens <= 1:
        return None
    return span / (tokens - 1)


def _ended(session: Session, job: Job) -> None:
    """The job's end is written (its finished_at, for the first time): its webhook, if it
    has one, goes into the outbox in the same transaction, so an ended job's webhook is
    never lost and never sent for a job that did not end (tasks/webhooks.py sends it)."""
    if job.callback_url:
        session.add(WebhookDelivery(**_webhook_outbox_row(job.id, job.tenant_id,
                                                          job.callback_url)))


def _webhook_outbox_row(job_id: str, tenant_id: int, url: str) -> OutboxRow:
    now = utcnow()
    return {"id": f"msg_{secrets.token_hex(12)}", "job_id": job_id, "tenant_id": tenant_id,
            "url": url, "status": DeliveryStatus.PENDING, "attempts": 0,
            "next_attempt_at": now, "created_at": now}
