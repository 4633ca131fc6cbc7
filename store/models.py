"""SQLAlchemy 2 models: tenants, jobs, chat sessions and traffic samples.

The types are portable between SQLite (default) and PostgreSQL (production). Constraint
names follow one naming convention so migrations and batch mode on SQLite can address them.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Date,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tidegate.records import JobStatus

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware datetime stored as UTC.

    SQLite has no timezone type and hands back naive values; this type makes both
    dialects return aware UTC datetimes, so durations computed from them are correct.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: pass a timezone-aware datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON(), list[str]: JSON()}


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (UniqueConstraint("name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    # The tenant's first key before keys had a table of their own (migration 0010 copied
    # it to api_keys); no longer read or written.
    key_hash: Mapped[str | None] = mapped_column(String(64), unique=True, index=True)
    lanes: Mapped[list[str]] = mapped_column(JSON)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    # Per-minute limits; None is unlimited. Enforced by the API with Redis counters.
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    # Where the tenant's jobs without a callback_url of their own report their end.
    webhook_url: Mapped[str | None] = mapped_column(String(2048))
    # The highest public priority (0-9, 9 most urgent) the tenant's jobs may ask; None:
    # the lane's default priority, so no tenant jumps ahead of a shared lane's traffic
    # unless an admin grants it (api/submit.py).
    max_priority: Mapped[int | None] = mapped_column(Integer)
    # Tokens (prompt plus completion) the tenant may use in a calendar month (UTC), as the
    # usage ledger counts them; None: no budget. Spent: a submit answers 429
    # `quota_exceeded` (api/limits.py). BigInteger: a budget may pass 2**31 tokens.
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    # The tenant's weight in each lane's fair queuing (tidegate/fairq.py): backlogged
    # tenants share a lane's queue in proportion to their weights. None: 1.
    fair_weight: Mapped[int | None] = mapped_column(Integer)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key"),
        CheckConstraint(
            "status IN ('queued', 'running', 'done', 'error', 'cancelled', 'expired')",
            name="status",
        ),
        # Sweeps (expiry, stuck jobs) look for old jobs in a given status.
        Index(None, "status", "enqueued_at"),
        # Every submit counts its tenant's queued and running jobs (the in-flight cap,
        # api/limits.py): two ranges of this index, at most the cap's entries long.
        Index(None, "tenant_id", "status"),
        # The reconciler's scan (scheduler/reconcile.py): jobs not ended yet, queued,
        # running, or cancelled while running and not finished by a worker. Partial, so
        # its size is the live backlog, not the history.
        Index("ix_jobs_unended", "enqueued_at", sqlite_where=text("finished_at IS NULL"),
              postgresql_where=text("finished_at IS NULL")),
        # A tenant's jobs listed in acceptance order, page after page (GET /v1/jobs).
        Index(None, "tenant_id", "enqueued_at", "id"),
        # The retention purge's scan (scheduler/retention.py): ended jobs that still hold
        # output text, oldest first. Partial: its size is the retention window's jobs.
        Index("ix_jobs_text_kept", "finished_at",
              sqlite_where=text("output_text IS NOT NULL"),
              postgresql_where=text("output_text IS NOT NULL")),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    # No index of its own: uq_jobs_tenant_id_idempotency_key starts with tenant_id.
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    lane: Mapped[str] = mapped_column(String(64))
    queue: Mapped[str] = mapped_column(String(255))
    priority: Mapped[int] = mapped_column(Integer)
    session_id: Mapped[str | None] = mapped_column(String(255), index=True)
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED.value)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    # Prompt tokens the engine served from its prefix cache (vLLM's count) on the last attempt.
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[str | None] = mapped_column(Text)
    output_text: Mapped[str | None] = mapped_column(Text)  # generated text, never the prompt
    enqueued_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    first_token_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    queue_wait_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    tpot_ms: Mapped[float | None] = mapped_column(Float)
    worker: Mapped[str | None] = mapped_column(String(255))
    engine: Mapped[str | None] = mapped_column(String(64))
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    lora: Mapped[str | None] = mapped_column(String(128))  # LoRA adapter the job asked for
    route_reason: Mapped[str | None] = mapped_column(Text)  # the router's decision and why
    # The task's payload (tasks.payloads.GeneratePayload, its JSON form, prompt included),
    # written with the row: an accepted job is durable, and a message Redis lost is sent
    # again from here (scheduler/reconcile.py). Cleared when the job ends (finished_at set):
    # prompts are not kept after that.
    payload: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    # Where the job's end is POSTed, signed (tasks/webhooks.py); None: no webhook.
    callback_url: Mapped[str | None] = mapped_column(String(2048))
    # The OpenTelemetry trace the job's spans belong to (32 hex digits; tidegate/tracing.py):
    # the submit's. None when the API that accepted it was not tracing.
    trace_id: Mapped[str | None] = mapped_column(String(32))


class ChatSession(Base):
    """A tenant's conversation. Keyed by tenant and id: two tenants' sessions of the same
    id are two sessions, and no tenant can claim (or learn of) an id another uses."""

    __tablename__ = "sessions"
    __table_args__ = (PrimaryKeyConstraint("tenant_id", "id"),)

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    id: Mapped[str] = mapped_column(String(255))
    turns: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_worker: Mapped[str | None] = mapped_column(String(255))
    last_seen: Mapped[datetime] = mapped_column(index=True)


class TrafficSample(Base):
    """Arrivals of one lane in one minute: the history the traffic forecast reads."""

    __tablename__ = "traffic"
    # Also the index of the forecaster's range reads (one lane, a span of minutes).
    __table_args__ = (UniqueConstraint("lane", "minute"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    lane: Mapped[str] = mapped_column(String(64))
    minute: Mapped[datetime]  # UTC, truncated to the minute
    arrivals: Mapped[int] = mapped_column(Integer)


class File(Base):
    """A file uploaded for the Batch API (purpose `batch`), or one a batch wrote (its
    output and errors, purpose `batch_output`): JSONL text, at most the API's file limit,
    held in `file_parts` (migration 0013 moved it there from a `content` column)."""

    __tablename__ = "files"
    __table_args__ = (Index(None, "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime]
    # The purge (scheduler/retention.py) deletes the file after this (an open batch's
    # input waits for its batch's end). None on rows written before migration 0013: the
    # purge counts their retention from created_at.
    expires_at: Mapped[datetime | None] = mapped_column(index=True)


class FilePart(Base):
    """One slice of a file's text (store/batches.py `PART_CHARS` characters), in order: a
    file is written, read and served a part at a time, so neither the API nor the
    database ever loads a whole file to serve it."""

    __tablename__ = "file_parts"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    text: Mapped[str] = mapped_column(Text)


class Batch(Base):
    """A batch of chat completions (OpenAI's Batch API): its state lives here, so it goes
    on after any process restarts. Each line of its input file becomes a job with the
    idempotency key `<batch id>:<line>`; `submitted` lines have been handed to the queue
    (or refused, as `line_errors` say)."""

    __tablename__ = "batches"
    __table_args__ = (Index(None, "status"), Index(None, "tenant_id", "created_at"))

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    status: Mapped[str] = mapped_column(String(16))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(8))
    input_file_id: Mapped[str] = mapped_column(String(64))
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer, default=0)
    submitted: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    line_errors: Mapped[list[Any]] = mapped_column(JSON, default=list)
    errors: Mapped[list[Any] | None] = mapped_column(JSON(none_as_null=True))
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON(none_as_null=True))
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
    # The batch's output and error files expire this long after they are written
    # (`output_expires_after.seconds`, else TIDEGATE_BATCH_OUTPUT_RETENTION_DAYS).
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer)
    # The model its lines named (the first line submitted), and the tokens of its
    # completed lines (OpenAI's batch `usage`), kept as the driver goes (migration 0015).
    model: Mapped[str | None] = mapped_column(String(256))
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))


class WebhookSecret(Base):
    """A tenant's signing secret. Rotating adds a new one and gives the old ones an end:
    until then a webhook carries a signature by each (Standard Webhooks' overlap)."""

    __tablename__ = "webhook_secrets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    # whsec_<base64>, sealed with the server's key (a Fernet token: tidegate/sealing.py)
    secret: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime | None]


class WebhookDelivery(Base):
    """One job's end (or a batch's) to deliver to one URL: written in the transaction that
    ends the job (an outbox), sent by the scheduler's dispatcher to the webhook workers,
    retried with backoff until delivered or a day has passed. Its id is the `webhook-id` header: a
    receiver dedupes on it."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index(None, "status", "next_attempt_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str | None] = mapped_column(String(36), index=True)  # None: a batch's
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    # What it tells: None is a job's end (`job.ended`); else a batch's end,
    # `batch.completed` and the like, about `batch_id` (migration 0015).
    event: Mapped[str | None] = mapped_column(String(32))
    batch_id: Mapped[str | None] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(String(2048))
    status: Mapped[str] = mapped_column(String(16))  # pending, sending, delivered, failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime]
    created_at: Mapped[datetime]
    delivered_at: Mapped[datetime | None]
    last_error: Mapped[str | None] = mapped_column(Text)


class WebhookAttempt(Base):
    """One POST of a delivery, as the receiver answered it (or did not)."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime]
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    duration_ms: Mapped[float] = mapped_column(Float)


class ApiKey(Base):
    """One of a tenant's API keys, by name: only its sha256 is stored (shown once). Keys
    rotate and are revoked without touching the tenant, its jobs or its sessions."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    created_at: Mapped[datetime]
    last_used_at: Mapped[datetime | None]  # updated at most once a minute
    expires_at: Mapped[datetime | None]  # a rotated key's overlap ends here
    revoked_at: Mapped[datetime | None]


class AdminKey(Base):
    """A key of the admin API (/admin/v1): never a tenant's."""

    __tablename__ = "admin_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


class UsageDay(Base):
    """A tenant's usage in one lane on one day (UTC, the day its jobs ended): the tokens of
    its ended jobs' rows and the jobs by how they ended. Written in the transaction that
    ends a job (store/usage.py), so it equals the sum of the job rows, exactly; a retried
    end finds its own end in the row and adds nothing. Its primary key is also the index
    of every read (a tenant's days, a month's sum)."""

    __tablename__ = "usage"
    __table_args__ = (PrimaryKeyConstraint("tenant_id", "day", "lane"),)

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    day: Mapped[date] = mapped_column(Date)
    lane: Mapped[str] = mapped_column(String(64))
    # Prompt tokens of the jobs a worker took (a job ended before any worker took it was
    # never prefilled: it counts as a job, with no tokens).
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Of those, served from the engine's prefix cache (vLLM's count).
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    jobs_done: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    jobs_error: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    jobs_cancelled: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    jobs_expired: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
