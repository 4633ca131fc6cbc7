"""Webhooks in the store: tenants' signing secrets, deliveries and their attempts.

A delivery is written in the transaction that ends its job (store/db.py `_ended`); here
the dispatcher claims the due ones, and the webhook worker records each attempt
(tasks/webhooks.py).
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import func, or_, select, update

from store.db import Store, utcnow
from store.models import Tenant, WebhookAttempt, WebhookDelivery, WebhookSecret

PENDING, SENDING, DELIVERED, FAILED = "pending", "sending", "delivered", "failed"


@dataclass(frozen=True)
class AttemptRecord:
    attempt: int
    at: datetime
    status_code: int | None
    error: str | None
    duration_ms: float


@dataclass(frozen=True)
class DeliveryRecord:
    id: str  # the `webhook-id` header
    job_id: str
    tenant_id: int
    url: str
    status: str
    attempts: int
    next_attempt_at: datetime
    created_at: datetime
    delivered_at: datetime | None
    last_error: str | None
    log: list[AttemptRecord] = field(default_factory=list)


def _delivery(row: WebhookDelivery, log: list[AttemptRecord] | None = None) -> DeliveryRecord:
    return DeliveryRecord(id=row.id, job_id=row.job_id, tenant_id=row.tenant_id, url=row.url,
                          status=row.status, attempts=row.attempts,
                          next_attempt_at=row.next_attempt_at, created_at=row.created_at,
                          delivered_at=row.delivered_at, last_error=row.last_error,
                          log=log or [])


class Webhooks:
    def __init__(self, store: Store) -> None:
        self.store = store

    # -- secrets -------------------------------------------------------------------

    def rotate_secret(self, tenant_id: int, overlap: timedelta) -> str:
        """A new signing secret (shown once: `whsec_` and 32 random bytes in base64); the
        tenant's older ones keep signing for `overlap`, then lapse."""
        now = utcnow()
        secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
        with self.store._write() as session:
            session.execute(update(WebhookSecret)
                            .where(WebhookSecret.tenant_id == tenant_id,
                                   or_(WebhookSecret.expires_at.is_(None),
                                       WebhookSecret.expires_at > now + overlap))
                            .values(expires_at=now + overlap))
            session.add(WebhookSecret(tenant_id=tenant_id, secret=secret, created_at=now))
        return secret

    def secrets_of(self, tenant_id: int) -> list[str]:
        """The tenant's live secrets, newest first (a webhook is signed with each)."""
        now = utcnow()
        stmt = (select(WebhookSecret.secret)
                .where(WebhookSecret.tenant_id == tenant_id,
                       or_(WebhookSecret.expires_at.is_(None), WebhookSecret.expires_at > now))
                .order_by(WebhookSecret.id.desc()))
        with self.store._read() as session:
            return list(session.scalars(stmt))

    def set_tenant_url(self, name: str, url: str | None) -> bool:
        with self.store._write() as session:
            done = session.execute(update(Tenant).where(Tenant.name == name)
                                   .values(webhook_url=url))
            return bool(done.rowcount)  # type: ignore[attr-defined]

    # -- deliveries ----------------------------------------------------------------

    def claim_due(self, lease: timedelta, limit: int) -> list[DeliveryRecord]:
        """Deliveries due now, marked `sending` until `lease` from now: one sent and not
        answered by then (its worker died) is due again, with the same webhook-id."""
        now = utcnow()
        stmt = (select(WebhookDelivery)
                .where(WebhookDelivery.status.in_((PENDING, SENDING)),
                       WebhookDelivery.next_attempt_at <= now)
                .order_by(WebhookDelivery.next_attempt_at).limit(limit)
                .with_for_update(skip_locked=True))
        with self.store._write() as session:
            rows = list(session.scalars(stmt))
            for row in rows:
                row.status, row.next_attempt_at = SENDING, now + lease
            return [_delivery(row) for row in rows]

    def backlog(self) -> tuple[int, datetime | None]:
        """Deliveries not delivered nor given up yet (pending, or sending), and when the
        oldest of them was written (None: none wait)."""
        stmt = (select(func.count(), func.min(WebhookDelivery.created_at))
                .where(WebhookDelivery.status.in_((PENDING, SENDING))))
        with self.store._read() as session:
            count, oldest = session.execute(stmt).one()
        return int(count), oldest

    def get(self, delivery_id: str) -> DeliveryRecord | None:
        with self.store._read() as session:
            row = session.get(WebhookDelivery, delivery_id)
            return _delivery(row) if row is not None else None

    def record_attempt(self, delivery_id: str, status_code: int | None, error: str | None,
                       duration_ms: float, next_at: datetime | None) -> DeliveryRecord | None:
        """One attempt's outcome: a 2xx delivers; otherwise the delivery is due again at
        `next_at`, or has failed for good (None)."""
        now = utcnow()
        ok = status_code is not None and 200 <= status_code < 300
        with self.store._write() as session:
            row = session.get(WebhookDelivery, delivery_id, with_for_update=True)
            if row is None or row.status in (DELIVERED, FAILED):
                return None  # delivered meanwhile: a late duplicate's outcome is dropped
            row.attempts += 1
            session.add(WebhookAttempt(delivery_id=delivery_id, attempt=row.attempts, at=now,
                                       status_code=status_code, error=error,
                                       duration_ms=duration_ms))
            if ok:
                row.status, row.delivered_at, row.last_error = DELIVERED, now, None
            else:
                row.last_error = error or f"HTTP {status_code}"
                row.status = PENDING if next_at is not None else FAILED
                row.next_attempt_at = next_at or now
            session.flush()
            return _delivery(row)

    def of_job(self, job_id: str, tenant_id: int) -> list[DeliveryRecord]:
        with self.store._read() as session:
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
