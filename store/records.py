"""Plain frozen records returned by the store, and the store's errors.

Callers never get live ORM objects: these records are safe to pass between threads and
to keep after the database session that read them is closed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from store.models import ChatSession, Job, Tenant, TrafficSample
from tidegate.records import TERMINAL_STATUSES, JobStatus


class TenantExistsError(ValueError):
    """A tenant with this name already exists."""

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant {name!r} already exists")
        self.name = name


@dataclass(frozen=True)
class TenantRecord:
    id: int
    name: str
    lanes: tuple[str, ...]
    created_at: datetime
    revoked_at: datetime | None
    requests_per_minute: int | None = None  # None: unlimited
    tokens_per_minute: int | None = None
    webhook_url: str | None = None  # the default callback_url of the tenant's jobs
    max_priority: int | None = None  # the most its jobs may ask; None: the lane's default
    monthly_token_budget: int | None = None  # tokens a calendar month (UTC); None: no budget
    fair_weight: int | None = None  # its weight in a lane's fair queuing; None: 1

    @property
    def active(self) -> bool:
        return self.revoked_at is None


@dataclass(frozen=True)
class JobRecord:
    id: str
    tenant_id: int
    lane: str
    queue: str
    priority: int
    session_id: str | None
    status: JobStatus
    idempotency_key: str | None
    sampling: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int | None
    finish_reason: str | None
    error: str | None
    output_text: str | None
    enqueued_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    queue_wait_ms: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    worker: str | None
    engine: str | None
    attempts: int
    lora: str | None = None
    route_reason: str | None = None
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (1st token)
    callback_url: str | None = None  # where the job's end is POSTed (a webhook)
    trace_id: str | None = None  # its OpenTelemetry trace (32 hex digits); None: not traced

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclass(frozen=True)
class SessionRecord:
    id: str
    tenant_id: int
    turns: int
    last_worker: str | None
    last_seen: datetime


@dataclass(frozen=True)
class TrafficRecord:
    lane: str
    minute: datetime  # UTC, truncated to the minute
    arrivals: int


def tenant_record(tenant: Tenant) -> TenantRecord:
    return TenantRecord(
        id=tenant.id,
        name=tenant.name,
        lanes=tuple(tenant.lanes),
        created_at=tenant.created_at,
        revoked_at=tenant.revoked_at,
        requests_per_minute=tenant.requests_per_minute,
        tokens_per_minute=tenant.tokens_per_minute,
        webhook_url=tenant.webhook_url,
        max_priority=tenant.max_priority,
        monthly_token_budget=tenant.monthly_token_budget,
        fair_weight=tenant.fair_weight,
    )


JOB_FIELDS = tuple(f.name for f in fields(JobRecord))  # each a column of `jobs`


def job_record(job: Job) -> JobRecord:
    values = {name: getattr(job, name) for name in JOB_FIELDS}
    values["sampling"] = dict(job.sampling or {})  # a copy: the record must not alias ORM state
    values["status"] = JobStatus(job.status)
    return JobRecord(**values)


def row_job_record(row: Mapping[Any, Any]) -> JobRecord:
    """A JobRecord from a Core row of the JOB_FIELDS columns (the hot paths of
    store/jobs.py and store/runs.py)."""
    values = {name: row[name] for name in JOB_FIELDS}
    values["sampling"] = dict(values["sampling"] or {})
    values["status"] = JobStatus(values["status"])
    return JobRecord(**values)


def session_record(session: ChatSession) -> SessionRecord:
    return SessionRecord(
        id=session.id,
        tenant_id=session.tenant_id,
        turns=session.turns,
        last_worker=session.last_worker,
        last_seen=session.last_seen,
    )


def traffic_record(sample: TrafficSample) -> TrafficRecord:
    return TrafficRecord(lane=sample.lane, minute=sample.minute, arrivals=sample.arrivals)
