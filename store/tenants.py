"""Tenants' settings and keys, and the admin API's own keys (api/admin.py, the CLI).

A tenant holds several named keys. Rotating one makes a new key under the same name and
gives the old one an end (`overlap`: both work until then); revoking ends it at once.
Neither touches the tenant, so its jobs, sessions and webhooks stay as they are. A key
is shown once, when it is made: only its sha256 is stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update

from store.db import Store, hash_key, new_api_key, utcnow
from store.models import AdminKey, ApiKey, Tenant
from store.records import TenantRecord, tenant_record

ADMIN_KEY_PREFIX = "tga_"
TENANT_FIELDS = ("lanes", "requests_per_minute", "tokens_per_minute", "webhook_url",
                 "max_priority", "monthly_token_budget", "fair_weight")


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
    def __init__(self, store: Store) -> None:
        self.store = store

    def get(self, name: str) -> TenantRecord | None:
        with self.store._read() as session:
            row = session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()
            return tenant_record(row) if row is not None else None

    def update(self, name: str, **values: Any) -> TenantRecord | None:
        """Change a tenant's lanes, limits, default webhook or highest priority
        (TENANT_FIELDS; max_priority None: each lane's default priority)."""
        unknown = set(values) - set(TENANT_FIELDS)
        if unknown:
            raise ValueError(f"not a tenant setting: {sorted(unknown)}")
        with self.store._write() as session:
            row = session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()
            if row is None:
                return None
            for field, value in values.items():
                setattr(row, field, list(value) if field == "lanes" else value)
            session.flush()
            return tenant_record(row)

    # -- keys ----------------------------------------------------------------------

    def add_key(self, tenant_id: int, name: str,
                expires_at: datetime | None = None) -> tuple[KeyRecord, str]:
        key = new_api_key()
        row = ApiKey(tenant_id=tenant_id, name=name, key_hash=hash_key(key),
                     created_at=utcnow(), expires_at=expires_at)
        with self.store._write() as session:
            session.add(row)
            session.flush()
            return _key(row), key

    def keys_of(self, tenant_id: int) -> list[KeyRecord]:
        with self.store._read() as session:
            rows = session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id)
                                   .order_by(ApiKey.id))
            return [_key(row) for row in rows]

    def revoke_key(self, tenant_id: int, key_id: int) -> KeyRecord | None:
        """End the key now (a key already revoked comes back as it is); None: no such key."""
        with self.store._write() as session:
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
        with self.store._write() as session:
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
        with self.store._write() as session:
            session.add(AdminKey(name=name, key_hash=hash_key(key), created_at=utcnow()))
        return key

    def is_admin_key(self, key: str) -> bool:
        stmt = select(AdminKey.id).where(AdminKey.key_hash == hash_key(key),
                                         AdminKey.revoked_at.is_(None))
        with self.store._read() as session:
            return session.scalar(stmt) is not None

    def revoke_admin_key(self, name: str) -> bool:
        with self.store._write() as session:
            done = session.execute(update(AdminKey).where(AdminKey.name == name,
                                                          AdminKey.revoked_at.is_(None))
                                   .values(revoked_at=utcnow()))
            return bool(done.rowcount)  # type: ignore[attr-defined]
