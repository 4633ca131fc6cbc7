"""Tenants' settings and keys, and the admin API's own keys (api/admin.py, the CLI).

A tenant holds several named keys. Rotating one makes a new key under the same name and
gives the old one an end (`overlap`: both work until then); revoking ends it at once.
Neither touches the tenant, so its jobs, sessions and webhooks stay as they are. A key
is shown once, when it is made: only its sha256 is stored.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError

from store.clock import utcnow
from store.database import Database
from store.models import AdminKey, ApiKey, Tenant
from store.records import TenantExistsError, TenantRecord, tenant_record

API_KEY_PREFIX = "tg_"
ADMIN_KEY_PREFIX = "tga_"
KEY_USE_RESOLUTION = timedelta(minutes=1)  # a key's last_used_at is this precise
TENANT_FIELDS = ("lanes", "requests_per_minute", "tokens_per_minute", "webhook_url",
                 "max_priority", "monthly_token_budget", "fair_weight")


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class KeyRecord:
    id: int
    tenant_id: int
    name: str
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > utcnow())


def _key(row: ApiKey) -> KeyRecord:
    return KeyRecord(id=row.id, tenant_id=row.tenant_id, name=row.name,
                     created_at=row.created_at, last_used_at=row.last_used_at,
                     expires_at=row.expires_at, revoked_at=row.revoked_at)


class Tenants:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create_tenant(self, name: str, lanes: list[str], requests_per_minute: int | None = None,
                      tokens_per_minute: int | None = None,
                      max_priority: int | None = None) -> tuple[TenantRecord, str]:
        """Create a tenant; returns its record and its API key (only the hash is stored).
        max_priority: the most its jobs may ask (None: each lane's default priority)."""
        if not name:
            raise ValueError("tenant name is empty")
        api_key = new_api_key()
        tenant = Tenant(
            name=name, lanes=list(lanes), created_at=utcnow(),
            requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute,
            max_priority=max_priority,
        )
        try:
            with self.db.write() as session:
                session.add(tenant)
                session.flush()
                session.add(ApiKey(tenant_id=tenant.id, name="default",
                                   key_hash=hash_key(api_key), created_at=tenant.created_at))
                record = tenant_record(tenant)
        except IntegrityError as exc:
            raise TenantExistsError(name) from exc
        return record, api_key

    def tenant_by_key(self, api_key: str) -> TenantRecord | None:
        """The active tenant holding api_key; None when the key is unknown, revoked or
        expired, or its tenant revoked. Notes the key's use (at most once a minute)."""
        now = utcnow()
        stmt = (select(Tenant, ApiKey).join(ApiKey, ApiKey.tenant_id == Tenant.id)
                .where(ApiKey.key_hash == hash_key(api_key), ApiKey.revoked_at.is_(None),
                       or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
                       Tenant.revoked_at.is_(None)))
        with self.db.read() as session:
            row = session.execute(stmt).one_or_none()
            if row is None:
                return None
            tenant, key = row
            record, key_id, used = tenant_record(tenant), key.id, key.last_used_at
        if used is None or now - used > KEY_USE_RESOLUTION:
            with self.db.write() as session:
                session.execute(update(ApiKey).where(ApiKey.id == key_id)
                                .values(last_used_at=now))
        return record

    def list_tenants(self) -> list[TenantRecord]:
        with self.db.read() as session:
            return [tenant_record(t) for t in session.scalars(select(Tenant).order_by(Tenant.id))]

    def revoke_tenant(self, name: str) -> bool:
        """Revoke a tenant's key; False when unknown or already revoked."""
        stmt = (
            update(Tenant)
            .where(Tenant.name == name, Tenant.revoked_at.is_(None))
            .values(revoked_at=utcnow())
            .returning(Tenant.id)
        )
        with self.db.write() as session:
            return session.scalar(stmt) is not None

    def get(self, name: str) -> TenantRecord | None:
        with self.db.read() as session:
            row = session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()
            return tenant_record(row) if row is not None else None

    def update(self, name: str, **values: object) -> TenantRecord | None:
        """Change a tenant's lanes, limits, default webhook or highest priority
        (TENANT_FIELDS; max_priority None: each lane's default priority)."""
        unknown = set(values) - set(TENANT_FIELDS)
        if unknown:
            raise ValueError(f"not a tenant setting: {sorted(unknown)}")
        with self.db.write() as session:
            row = session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()
            if row is None:
                return None
            for field, value in values.items():
                setattr(row, field, _lanes(value) if field == "lanes" else value)
            session.flush()
            return tenant_record(row)

    # -- keys ----------------------------------------------------------------------

    def add_key(self, tenant_id: int, name: str,
                expires_at: datetime | None = None) -> tuple[KeyRecord, str]:
        key = new_api_key()
        row = ApiKey(tenant_id=tenant_id, name=name, key_hash=hash_key(key),
                     created_at=utcnow(), expires_at=expires_at)
        with self.db.write() as session:
            session.add(row)
            session.flush()
            return _key(row), key

    def keys_of(self, tenant_id: int) -> list[KeyRecord]:
        with self.db.read() as session:
            rows = session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id)
                                   .order_by(ApiKey.id))
            return [_key(row) for row in rows]

    def revoke_key(self, tenant_id: int, key_id: int) -> KeyRecord | None:
        """End the key now (a key already revoked comes back as it is); None: no such key."""
        with self.db.write() as session:
            row = session.get(ApiKey, key_id)
            if row is None or row.tenant_id != tenant_id:
                return None
            row.revoked_at = row.revoked_at or utcnow()
            return _key(row)

    def rotate_key(self, tenant_id: int, key_id: int,
                   overlap: timedelta) -> tuple[KeyRecord, str] | None:
        """A new key under the old one's name; the old one works `overlap` more (0: ends
        now). None: no such live key."""
        now = utcnow()
        with self.db.write() as session:
            row = session.get(ApiKey, key_id)
            if row is None or row.tenant_id != tenant_id or row.revoked_at is not None:
                return None
            end = now + overlap
            if overlap.total_seconds() <= 0:
                row.revoked_at = now
            elif row.expires_at is None or row.expires_at > end:
                row.expires_at = end
            key = new_api_key()
            new = ApiKey(tenant_id=tenant_id, name=row.name, key_hash=hash_key(key),
                         created_at=now)
            session.add(new)
            session.flush()
            return _key(new), key

    # -- admin keys ------------------------------------------------------------------

    def create_admin_key(self, name: str) -> str:
        key = ADMIN_KEY_PREFIX + new_api_key().removeprefix("tg_")
        with self.db.write() as session:
            session.add(AdminKey(name=name, key_hash=hash_key(key), created_at=utcnow()))
        return key

    def is_admin_key(self, key: str) -> bool:
        stmt = select(AdminKey.id).where(AdminKey.key_hash == hash_key(key),
                                         AdminKey.revoked_at.is_(None))
        with self.db.read() as session:
            return session.scalar(stmt) is not None

    def revoke_admin_key(self, name: str) -> bool:
        with self.db.write() as session:
            done = session.execute(update(AdminKey).where(AdminKey.name == name,
                                                          AdminKey.revoked_at.is_(None))
                                   .values(revoked_at=utcnow()))
            return bool(done.rowcount)  # type: ignore[attr-defined]


def _lanes(value: object) -> list[str]:
    """A tenant's lanes as the row keeps them: a list of its own (the caller's may be a
    tuple, and must not alias the row's JSON)."""
    assert isinstance(value, Iterable), f"lanes: {value!r}"
    return [str(lane) for lane in value]
