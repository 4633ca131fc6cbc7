"""Webhooks in the store: tenants' signing secrets, deliveries and their attempts.

A delivery is written in the transaction that ends its job (store/runs.py `_ended`); here
the dispatcher claims the due ones (and fails those past their give-up time), and the
webhook worker begins, defers or records each attempt (tasks/webhooks.py).

Secrets are stored sealed (tidegate/sealing.py): the `sealer` given opens them for
signing. A row from before sealing (plain `whsec_...`) still signs until `seal_plain`
seals it (`tidegate webhooks` does at start).
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol

from sqlalchemy import ColumnElement, func, or_, select, update

from store.clock import utcnow
from store.database import Database
from store.models import Tenant, WebhookAttempt, WebhookDelivery, WebhookSecret
from tidegate.records import DeliveryStatus

PLAIN_PREFIX = "whsec_"
# Deliveries not delivered nor given up yet: due now, later, or claimed by a sender.
WAITING_STATUSES = (DeliveryStatus.PENDING, DeliveryStatus.SENDING)


class Outcome(StrEnum):
    """What became of an attempt, as its tenant sees it: a class, never an address or an
    exception's text (those would make GET /v1/jobs/{id}/deliveries a scanner of what
    the webhook sender can reach)."""

    SUCCESS = "2xx"
    REDIRECT = "3xx"  # redirects are not followed
    CLIENT_ERROR = "4xx"
    SERVER_ERROR = "5xx"
    TIMEOUT = "timeout"  # the attempt's deadline passed (TIDEGATE_WEBHOOK_TIMEOUT_S)
    CONNECT_FAILED = "connect_failed"  # no connection (DNS, refused, unreachable, TLS)
    BAD_RESPONSE = "bad_response"  # not an HTTP answer, or the connection broke in it
    RESPONSE_TOO_LARGE = "response_too_large"  # the body went past the read cap
    REFUSED_BY_POLICY = "refused_by_policy"  # the URL or its addresses are refused
    NO_SIGNING_SECRET = "no_signing_secret"  # the tenant has none (or it cannot be opened)
    JOB_GONE = "job_gone"
    ERROR = "error"  # anything else (a bug: the sender's log says more)
    GAVE_UP = "gave_up"  # a delivery's end: past TIDEGATE_WEBHOOK_GIVE_UP_S


def shown(error: str | None) -> str | None:
    """An attempt's error as a tenant may see it: rows written before outcome classes
    hold exception text, shown as `error`."""
    if error is None or error in Outcome._value2member_map_:
        return error
    return Outcome.ERROR.value


class Sealer(Protocol):
    """What seals and opens secrets (cryptography's MultiFernet: tidegate/sealing.py)."""

    def encrypt(self, data: bytes) -> bytes: ...

    def decrypt(self, token: bytes) -> bytes: ...


@dataclass(frozen=True)
class AttemptRecord:
    attempt: int
    at: datetime
    status_code: int | None
    error: str | None  # the Outcome of a failed attempt; None: delivered
    duration_ms: float


@dataclass(frozen=True)
class DeliveryRecord:
    id: str  # the `webhook-id` header
    job_id: str | None  # None: a batch's event
    tenant_id: int
    url: str
    status: DeliveryStatus
    attempts: int
    next_attempt_at: datetime
    created_at: datetime
    delivered_at: datetime | None
    last_error: str | None
    log: list[AttemptRecord] = field(default_factory=list)
    event: str | None = None  # None: `job.ended`; else a batch's (`batch.completed`, ...)
    batch_id: str | None = None


def _delivery(row: WebhookDelivery, log: list[AttemptRecord] | None = None) -> DeliveryRecord:
    return DeliveryRecord(id=row.id, job_id=row.job_id, tenant_id=row.tenant_id, url=row.url,
                          status=DeliveryStatus(row.status), attempts=row.attempts,
                          next_attempt_at=row.next_attempt_at, created_at=row.created_at,
                          delivered_at=row.delivered_at, last_error=row.last_error,
                          log=log or [], event=row.event, batch_id=row.batch_id)


def _live(tenant_id: int, now: datetime) -> tuple[ColumnElement[bool], ...]:
    return (WebhookSecret.tenant_id == tenant_id,
            or_(WebhookSecret.expires_at.is_(None), WebhookSecret.expires_at > now))


class Webhooks:
    def __init__(self, db: Database, sealer: Sealer | None = None) -> None:
        self.db = db
        self.sealer = sealer  # needed for secrets only

    # -- secrets -------------------------------------------------------------------

    def rotate_secret(self, tenant_id: int, overlap: timedelta, max_live: int) -> str:
        """A new signing secret (shown once: `whsec_` and 32 random bytes in base64); the
        tenant's older ones keep signing for `overlap`, then lapse, and of the live ones
        only the newest `max_live` stay: each signs every delivery, so they are bounded."""
        now = utcnow()
        secret = PLAIN_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()
        sealed = self._sealer().encrypt(secret.encode()).decode("ascii")
        with self.db.write() as session:
            session.execute(update(WebhookSecret)
                            .where(WebhookSecret.tenant_id == tenant_id,
                                   or_(WebhookSecret.expires_at.is_(None),
                                       WebhookSecret.expires_at > now + overlap))
                            .values(expires_at=now + overlap))
            session.add(WebhookSecret(tenant_id=tenant_id, secret=sealed, created_at=now))
            session.flush()
            live = session.scalars(select(WebhookSecret.id).where(*_live(tenant_id, now))
                                   .order_by(WebhookSecret.id.desc()))
            beyond = list(live)[max_live:]
            if beyond:
                session.execute(update(WebhookSecret).where(WebhookSecret.id.in_(beyond))
                                .values(expires_at=now))
        return secret

    def secrets_of(self, tenant_id: int) -> list[str]:
        """The tenant's live secrets, newest first (a webhook is signed with each).
        Raises the sealer's InvalidToken for a secret no key of this process opens."""
        stmt = (select(WebhookSecret.secret).where(*_live(tenant_id, utcnow()))
                .order_by(WebhookSecret.id.desc()))
        with self.db.read() as session:
            stored = list(session.scalars(stmt))
        return [self._open(value) for value in stored]

    def _open(self, value: str) -> str:
        if value.startswith(PLAIN_PREFIX):  # written before sealing; seal_plain seals it
            return value
        return self._sealer().decrypt(value.encode("ascii")).decode()

    def seal_plain(self) -> int:
        """Seals the secrets stored before sealing; returns how many."""
        with self.db.write() as session:
            rows = list(session.scalars(select(WebhookSecret).where(
                WebhookSecret.secret.startswith(PLAIN_PREFIX, autoescape=True))))
            for row in rows:
                row.secret = self._sealer().encrypt(row.secret.encode()).decode("ascii")
            return len(rows)

    def _sealer(self) -> Sealer:
        if self.sealer is None:
            raise RuntimeError("Webhooks(store) was made without a sealer: secrets need one")
        return self.sealer

    def set_tenant_url(self, name: str, url: str | None) -> bool:
        with self.db.write() as session:
            done = session.execute(update(Tenant).where(Tenant.name == name)
                                   .values(webhook_url=url))
            return bool(done.rowcount)  # type: ignore[attr-defined]

    # -- deliveries ----------------------------------------------------------------

    def due_tenants(self) -> set[int]:
        """The tenants that have a delivery due now."""
        stmt = (select(WebhookDelivery.tenant_id).distinct()
                .where(WebhookDelivery.status.in_(WAITING_STATUSES),
                       WebhookDelivery.next_attempt_at <= utcnow()))
        with self.db.read() as session:
            return set(session.scalars(stmt))

    def claim_due(self, lease: timedelta, limit: int, give_up: timedelta | None = None,
                  per_tenant: int | None = None,
                  skip_tenants: frozenset[int] = frozenset()) -> list[DeliveryRecord]:
        """Deliveries due now, marked `sending` until `lease` from now: one sent and not
        answered by then (its worker died) is due again, with the same webhook-id. A due
        delivery older than `give_up` is failed here instead, never claimed again. At most
        `per_tenant` of one tenant's are claimed at once, the earliest due first: a
        tenant's backlog cannot fill every claim ahead of another tenant's delivery. The
        due deliveries of `skip_tenants` (whose concurrency is full) stay as they are."""
        now = utcnow()
        due = (WebhookDelivery.status.in_(WAITING_STATUSES),
               WebhookDelivery.next_attempt_at <= now)
        stmt = select(WebhookDelivery).where(*due)
        if skip_tenants:
            stmt = stmt.where(WebhookDelivery.tenant_id.not_in(skip_tenants))
        if per_tenant is not None:
            ranked = (select(WebhookDelivery.id, func.row_number().over(
                partition_by=WebhookDelivery.tenant_id,
                order_by=WebhookDelivery.next_attempt_at).label("rank")).where(*due).subquery())
            stmt = stmt.where(WebhookDelivery.id.in_(
                select(ranked.c.id).where(ranked.c.rank <= per_tenant)))
        stmt = (stmt.order_by(WebhookDelivery.next_attempt_at).limit(limit)
                .with_for_update(skip_locked=True))
        with self.db.write() as session:
            if give_up is not None:
                session.execute(update(WebhookDelivery)
                                .where(*due, WebhookDelivery.created_at <= now - give_up)
                                .values(status=DeliveryStatus.FAILED,
                                        last_error=Outcome.GAVE_UP.value))
            rows = list(session.scalars(stmt))
            for row in rows:
                row.status, row.next_attempt_at = DeliveryStatus.SENDING, now + lease
            return [_delivery(row) for row in rows]

    def begin(self, delivery_id: str, lease: timedelta) -> DeliveryRecord | None:
        """The claimed delivery, its lease renewed from now for the attempt about to
        start; None when it is not claimed (delivered, failed, or recorded meanwhile by a
        duplicate of its task)."""
        with self.db.write() as session:
            row = session.get(WebhookDelivery, delivery_id, with_for_update=True)
            if row is None or row.status != DeliveryStatus.SENDING:
                return None
            row.next_attempt_at = utcnow() + lease
            session.flush()
            return _delivery(row)

    def defer(self, delivery_id: str, until: datetime) -> bool:
        """A claimed delivery back to pending until `until`, with no attempt counted (a
        concurrency cap was full: it waits, it has not failed)."""
        with self.db.write() as session:
            done = session.execute(update(WebhookDelivery)
                                   .where(WebhookDelivery.id == delivery_id,
                                          WebhookDelivery.status == DeliveryStatus.SENDING)
                                   .values(status=DeliveryStatus.PENDING,
                                           next_attempt_at=until))
            return bool(done.rowcount)  # type: ignore[attr-defined]

    def backlog(self) -> tuple[int, datetime | None]:
        """Deliveries not delivered nor given up yet (pending, or sending), and when the
        oldest of them was written (None: none wait)."""
        stmt = (select(func.count(), func.min(WebhookDelivery.created_at))
                .where(WebhookDelivery.status.in_(WAITING_STATUSES)))
        with self.db.read() as session:
            count, oldest = session.execute(stmt).one()
        return int(count), oldest

    def get(self, delivery_id: str) -> DeliveryRecord | None:
        with self.db.read() as session:
            row = session.get(WebhookDelivery, delivery_id)
            return _delivery(row) if row is not None else None

    def record_attempt(self, delivery_id: str, status_code: int | None, outcome: Outcome,
                       duration_ms: float, next_at: datetime | None) -> DeliveryRecord | None:
        """One attempt's outcome: a 2xx delivers; otherwise the delivery is due again at
        `next_at`, or has failed for good (None)."""
        now = utcnow()
        ok = outcome == Outcome.SUCCESS
        with self.db.write() as session:
            row = session.get(WebhookDelivery, delivery_id, with_for_update=True)
            if row is None or row.status in (DeliveryStatus.DELIVERED,
                                             DeliveryStatus.FAILED):
                return None  # delivered meanwhile: a late duplicate's outcome is dropped
            row.attempts += 1
            session.add(WebhookAttempt(delivery_id=delivery_id, attempt=row.attempts, at=now,
                                       status_code=status_code,
                                       error=None if ok else outcome.value,
                                       duration_ms=duration_ms))
            if ok:
                row.status, row.delivered_at = DeliveryStatus.DELIVERED, now
                row.last_error = None
            else:
                row.last_error = outcome.value
                row.status = (DeliveryStatus.PENDING if next_at is not None
                              else DeliveryStatus.FAILED)
                row.next_attempt_at = next_at or now
            session.flush()
            return _delivery(row)

    def of_job(self, job_id: str, tenant_id: int) -> list[DeliveryRecord]:
        with self.db.read() as session:
            rows = list(session.scalars(
                select(WebhookDelivery).where(WebhookDelivery.job_id == job_id,
                                              WebhookDelivery.tenant_id == tenant_id)
                .order_by(WebhookDelivery.created_at)))
            out = []
            for row in rows:
                attempts = session.scalars(select(WebhookAttempt)
                                           .where(WebhookAttempt.delivery_id == row.id)
                                           .order_by(WebhookAttempt.attempt))
                out.append(_delivery(row, [AttemptRecord(a.attempt, a.at, a.status_code,
                                                         a.error, a.duration_ms)
                                           for a in attempts]))
            return out
