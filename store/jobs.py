"""Jobs: their rows written at submit, and every read of them (the API, the reconciler,
the scheduler's gauges). A job's run (its claim, first token and end, or its cancel or
expiry) is store/runs.py's.

The statements every submit runs (insert, read by id and key, the in-flight count) are
Core statements built once here; on PostgreSQL they run on the driver itself, a single
statement each in autocommit (store/hot.py; a group of inserts is one transaction).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypedDict, cast

from sqlalchemy import (
    Column,
    ColumnElement,
    Insert,
    Select,
    Table,
    bindparam,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import defer
from sqlalchemy.sql.dml import ReturningInsert

from store.clock import aware, utcnow
from store.database import Database
from store.group_insert import GroupInsert
from store.models import Job
from store.records import JOB_FIELDS, JobRecord, job_record, row_job_record
from store.sessions import count_turn
from tidegate.records import ACTIVE_STATUSES, JobStatus

JOBS = cast(Table, Job.__table__)
JOB_COLUMNS: tuple[Column[Any], ...] = tuple(JOBS.c[name] for name in JOB_FIELDS)
# Built once: building a statement cost as much CPU as running it.
BY_ID: ColumnElement[bool] = JOBS.c.id == bindparam("job_id")
SELECT_JOB: Select[Any] = select(*JOB_COLUMNS).where(BY_ID)
_SELECT_BY_KEY = select(*JOB_COLUMNS).where(JOBS.c.tenant_id == bindparam("tenant_id"),
                                            JOBS.c.idempotency_key == bindparam("key"))
_INSERT_JOB = insert(JOBS).returning(*JOB_COLUMNS)
_COUNT_IN_FLIGHT = (select(func.count()).select_from(JOBS)
                    .where(JOBS.c.tenant_id == bindparam("tenant_id"),
                           JOBS.c.status.in_(ACTIVE_STATUSES)))


class QueuedRow(TypedDict, total=False):
    """A queued job's INSERT parameters; a column left out takes its default."""

    id: str
    tenant_id: int
    lane: str
    queue: str
    priority: int
    session_id: str
    status: JobStatus
    idempotency_key: str
    sampling: dict[str, Any]  # the request's sampling parameters, as JSON
    prompt_tokens: int
    enqueued_at: datetime
    attempts: int
    lora: str
    route_reason: str
    payload: dict[str, Any]  # the task's JSON form (tasks.payloads)
    callback_url: str
    trace_id: str


@functools.lru_cache(maxsize=64)
def _insert_of(columns: tuple[str, ...]) -> ReturningInsert[Any]:
    """The job INSERT of these columns (a queued row leaves out those it has no value
    for), built once per set."""
    stmt: Insert = insert(JOBS).values({name: bindparam(name, type_=JOBS.c[name].type)
                                        for name in columns})
    return stmt.returning(*JOB_COLUMNS)


def _queued_row(job_id: str, tenant_id: int, lane: str, queue: str, priority: int,
                session_id: str | None, sampling: Mapping[str, object], prompt_tokens: int,
                idempotency_key: str | None, lora: str | None,
                route_reason: str | None, payload: Mapping[str, object] | None,
                callback_url: str | None = None, trace_id: str | None = None) -> QueuedRow:
    """A queued job's INSERT parameters (a column left out takes its default). A dict, not
    a Job: building the ORM object, then reading it back, cost 2% of a submit's CPU."""
    row = {
        "id": job_id, "tenant_id": tenant_id, "lane": lane, "queue": queue,
        "priority": priority, "session_id": session_id, "status": JobStatus.QUEUED,
        "idempotency_key": idempotency_key, "sampling": dict(sampling),
        "prompt_tokens": prompt_tokens, "enqueued_at": utcnow(), "attempts": 0, "lora": lora,
        "route_reason": route_reason, "payload": dict(payload) if payload is not None else None,
        "callback_url": callback_url, "trace_id": trace_id,
    }
    return cast(QueuedRow, {name: value for name, value in row.items() if value is not None})


class Jobs:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._group_insert = GroupInsert(self._insert_jobs)  # create_job's common case

    def create_job(
        self,
        job_id: str,
        tenant_id: int,
        lane: str,
        queue: str,
        priority: int,
        session_id: str | None,
        sampling: Mapping[str, object],
        prompt_tokens: int,
        idempotency_key: str | None = None,
        lora: str | None = None,
        route_reason: str | None = None,
        payload: Mapping[str, object] | None = None,
        callback_url: str | None = None,
        trace_id: str | None = None,
    ) -> tuple[JobRecord, bool, int]:
        """Write a queued job and count its session's turn (0 without a session) in one
        transaction; returns (job, created, turn).

        payload: the task's JSON form (tasks.payloads), kept with the row until the job
        ends so that a message Redis lost can be sent again; its "turn" is set to the
        turn counted here, in the same transaction.

        With an idempotency key this tenant already used, that job comes back with
        created=False and turn 0, and no turn is counted. The session is the tenant's
        (session_id names it within the tenant: store/models.py ChatSession).

        trace_id: the submit's OpenTelemetry trace (tidegate/tracing.py), None if untraced.
        """
        row = _queued_row(job_id, tenant_id, lane, queue, priority, session_id, sampling,
                          prompt_tokens, idempotency_key, lora, route_reason, payload,
                          callback_url, trace_id)
        if session_id is not None:  # its turn is counted in the same transaction
            return self._insert_job(row, turn_of=session_id)
        # No read first: a key used before fails the insert on its unique index, and the
        # job it made comes back (the API's submit looked it up just before: api/submit.py).
        try:
            return self._group_insert.insert(row), True, 0
        except IntegrityError:
            existing = (self.job_by_idempotency_key(tenant_id, idempotency_key)
                        if idempotency_key is not None else None)
            if existing is None:
                raise
            return existing, False, 0

    def _insert_job(self, values: QueuedRow, turn_of: str | None) -> tuple[JobRecord, bool, int]:
        """Insert the row and, with turn_of, count that session's turn in the same
        transaction."""
        try:
            with self.db.write_conn() as conn:
                turn = (count_turn(conn, self.db.dialect, turn_of, values["tenant_id"], None)
                        if turn_of else 0)
                if turn and "payload" in values:
                    values["payload"] = {**values["payload"], "turn": turn}
                inserted = conn.execute(_INSERT_JOB, values).mappings().one()
                return row_job_record(inserted), True, turn
        except IntegrityError:
            # A concurrent request with the same key won the insert: answer with its job.
            key = values.get("idempotency_key")
            existing = self.job_by_idempotency_key(values["tenant_id"], key) if key else None
            if existing is None:
                raise
            return existing, False, 0

    def _insert_jobs(self, rows: list[QueuedRow]) -> list[JobRecord]:
        """Insert the rows in one transaction; their records, in order. Rows that set the
        same columns go in one multi-row INSERT (SQLAlchemy's insertmanyvalues). On
        PostgreSQL, an INSERT each on the driver (store/hot.py), in one transaction; a group
        of one in autocommit."""
        if self.db.hot is not None:
            inserts = [(_insert_of(tuple(values)), values) for values in rows]
            return [row_job_record(got[0]) for got in self.db.hot.rows_together(inserts)]
        by_columns: dict[tuple[str, ...], list[QueuedRow]] = {}
        for values in rows:
            by_columns.setdefault(tuple(values), []).append(values)
        inserted: dict[str, JobRecord] = {}
        with self.db.write_conn() as conn:
            for same in by_columns.values():
                params = same if len(same) > 1 else same[0]
                for got in conn.execute(_INSERT_JOB, params).mappings():
                    inserted[got["id"]] = row_job_record(got)
        return [inserted[values["id"]] for values in rows]

    def job_by_idempotency_key(self, tenant_id: int, idempotency_key: str) -> JobRecord | None:
        """The tenant's job submitted with this idempotency key, if any."""
        if self.db.hot is not None:
            rows = self.db.hot.rows(_SELECT_BY_KEY, {"tenant_id": tenant_id,
                                                     "key": idempotency_key})
            return row_job_record(rows[0]) if rows else None
        with self.db.read_conn() as conn:
            row = conn.execute(_SELECT_BY_KEY, {"tenant_id": tenant_id, "key": idempotency_key}
                               ).mappings().one_or_none()
        return row_job_record(row) if row is not None else None

    def get_job(self, job_id: str, tenant_id: int | None = None) -> JobRecord | None:
        """The job; with tenant_id, None unless the job belongs to that tenant."""
        row: Mapping[Any, Any] | None
        if self.db.hot is not None:
            rows = self.db.hot.rows(SELECT_JOB, {"job_id": job_id})
            row = rows[0] if rows else None
        else:
            with self.db.read_conn() as conn:
                row = conn.execute(SELECT_JOB, {"job_id": job_id}).mappings().one_or_none()
        if row is None or (tenant_id is not None and row["tenant_id"] != tenant_id):
            return None
        return row_job_record(row)

    def jobs_of_tenant(self, tenant_id: int, limit: int = 1000) -> list[JobRecord]:
        """A tenant's most recent jobs, oldest first."""
        stmt = (select(Job).where(Job.tenant_id == tenant_id)
                .order_by(Job.enqueued_at.desc()).limit(limit))
        with self.db.read() as session:
            return [job_record(job) for job in reversed(session.scalars(stmt).all())]

    def list_jobs(self, tenant_id: int, *, statuses: tuple[str, ...] = (),
                  lane: str | None = None, session_id: str | None = None,
                  created_after: datetime | None = None,
                  after: tuple[datetime, str] | None = None,
                  limit: int = 100) -> list[JobRecord]:
        """A tenant's jobs in the order they were accepted (then by id), filtered; `after`
        is the (enqueued_at, id) of the last job of the page before (keyset pagination:
        a page costs the same however deep it is, and jobs accepted meanwhile are not
        skipped or repeated). The payload column is not read."""
        stmt = select(Job).options(defer(Job.payload)).where(Job.tenant_id == tenant_id)
        if statuses:
            stmt = stmt.where(Job.status.in_(statuses))
        if lane is not None:
            stmt = stmt.where(Job.lane == lane)
        if session_id is not None:
            stmt = stmt.where(Job.session_id == session_id)
        if created_after is not None:
            stmt = stmt.where(Job.enqueued_at > aware(created_after))
        if after is not None:
            at, job_id = aware(after[0]), after[1]
            stmt = stmt.where((Job.enqueued_at > at)
                              | ((Job.enqueued_at == at) & (Job.id > job_id)))
        stmt = stmt.order_by(Job.enqueued_at, Job.id).limit(limit)
        with self.db.read() as session:
            return [job_record(job) for job in session.scalars(stmt)]

    def delete_job(self, job_id: str) -> bool:
        """Remove a job row (its enqueue failed after the row was written)."""
        with self.db.write() as session:
            return session.scalar(delete(Job).where(Job.id == job_id).returning(Job.id)) is not None

    def count_jobs(self, status: str | None = None) -> int:
        stmt = select(func.count()).select_from(Job)
        if status is not None:
            stmt = stmt.where(Job.status == status)
        with self.db.read() as session:
            return session.scalar(stmt) or 0

    def count_in_flight(self, tenant_id: int) -> int:
        """The tenant's queued and running jobs: two ranges of ix_jobs_tenant_id_status,
        read on every submit (the API's in-flight cap), so no longer than the cap."""
        with self.db.read_conn() as conn:
            return conn.execute(_COUNT_IN_FLIGHT, {"tenant_id": tenant_id}).scalar() or 0

    def in_flight_by_lane(self) -> dict[tuple[str, str], int]:
        """Queued and running jobs by (lane, status), in one GROUP BY over the partial
        index ix_jobs_unended (the live backlog, not the history): the scheduler's gauge."""
        stmt = (select(Job.lane, Job.status, func.count())
                .where(Job.finished_at.is_(None), Job.status.in_(ACTIVE_STATUSES))
                .group_by(Job.lane, Job.status))
        with self.db.read_conn() as conn:
            return {(lane, status): count for lane, status, count in conn.execute(stmt)}

    def unended_jobs(self, enqueued_before: datetime, limit: int) -> list[JobRecord]:
        """Jobs accepted before `enqueued_before` and not ended yet (no finished_at: queued,
        running, or cancelled while running and not yet finished), oldest first: the
        reconciler's candidates. Reads the partial index ix_jobs_unended, whose size is the
        live backlog; the payloads stay in the database (job_payload)."""
        stmt = (select(Job).options(defer(Job.payload))
                .where(Job.finished_at.is_(None), Job.enqueued_at < aware(enqueued_before))
                .order_by(Job.enqueued_at).limit(limit))
        with self.db.read() as session:
            return [job_record(job) for job in session.scalars(stmt)]

    def unended_queues(self, prefix: str) -> list[str]:
        """The queues named `prefix`... that jobs not ended yet were sent to (the
        reconciler's dead direct queues); a read of ix_jobs_unended's rows."""
        stmt = (select(Job.queue).distinct()
                .where(Job.finished_at.is_(None), Job.queue.startswith(prefix, autoescape=True)))
        with self.db.read() as session:
            return list(session.scalars(stmt))

    def job_payload(self, job_id: str) -> dict[str, Any] | None:
        """The task payload kept with a job that has not ended (None once it has)."""
        with self.db.read() as session:
            payload = session.scalar(select(Job.payload).where(Job.id == job_id))
            return dict(payload) if payload else None

    def note_requeue(self, job_id: str, queue: str, route_reason: str) -> bool:
        """A queued or running job whose message was sent again: its queue and why.
        False when the job ended meanwhile."""
        stmt = (
            update(Job)
            .where(Job.id == job_id, Job.status.in_(ACTIVE_STATUSES))
            .values(queue=queue, route_reason=route_reason)
            .returning(Job.id)
            .execution_options(synchronize_session=False)
        )
        with self.db.write() as session:
            return session.scalar(stmt) is not None
