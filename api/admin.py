"""The admin API, /admin/v1: tenants, their settings and their keys. It takes admin keys
only (`tidegate admin-key create NAME`), never a tenant's, and a tenant key never reaches
it. Keys are shown once, when made; revoking or rotating one, or changing a tenant,
is announced to every API process (api/auth.py), so a revoked key is refused at once.

    GET    /admin/v1/tenants                         every tenant
    POST   /admin/v1/tenants                         a tenant, and its first key (once)
    GET    /admin/v1/tenants/{name}                  one, with its keys (never the keys)
    PATCH  /admin/v1/tenants/{name}                  lanes, limits, default webhook, max_priority,
                                                     monthly_token_budget
    DELETE /admin/v1/tenants/{name}                  revoke the tenant (every key)
    POST   /admin/v1/tenants/{name}/keys             a new named key (once)
    POST   /admin/v1/tenants/{name}/keys/{id}/rotate a new key; the old one lives `overlap_s`
    DELETE /admin/v1/tenants/{name}/keys/{id}        revoke one key
    GET    /admin/v1/usage                           the usage ledger (api/usage.py)
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.auth import announce_change, bearer_key
from api.deps import Deps, check_headers, json_body
from api.errors import ApiError, bad_request, malformed, not_found, unauthorized
from api.schemas import check_text
from store import TenantExistsError, TenantRecord
from store.tenants import KeyRecord, Tenants
from tasks.webhooks import UrlMalformed, UrlRefused, check_url
from tidegate.jsontypes import JSONObject

M = TypeVar("M", bound=BaseModel)
MAX_OVERLAP_S = 30 * 86400
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
MAX_FAIR_WEIGHT = 1000  # a weight 1000x another's is already all but strict priority


class TenantSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lanes: list[str] | None = Field(None, min_length=1)
    # At most what the store's INTEGER columns hold (PostgreSQL's: 32 bits): a larger one
    # was a 500 (found by tests/stack/test_fuzz.py).
    requests_per_minute: int | None = Field(None, gt=0, le=MAX_INT32)
    tokens_per_minute: int | None = Field(None, gt=0, le=MAX_INT32)
    webhook_url: str | None = Field(None, min_length=1, max_length=2048)
    # The highest priority (0-9, 9 most urgent) its jobs may ask; null: each lane's default.
    max_priority: int | None = Field(None, ge=0, le=9)
    # Tokens (prompt plus completion) a calendar month (UTC); null: no budget. Spent, a
    # submit answers 429 `quota_exceeded` (api/limits.py). A BIGINT column.
    monthly_token_budget: int | None = Field(None, gt=0, le=MAX_INT64)
    # Its weight in each lane's fair queuing (tidegate/fairq.py): while tenants wait in a
    # lane, each is served tokens in proportion to its weight. null: 1.
    fair_weight: int | None = Field(None, ge=1, le=MAX_FAIR_WEIGHT)


class NewTenant(TenantSettings):
    name: str = Field(min_length=1, max_length=128)
    lanes: list[str] = Field(min_length=1)  # type: ignore[assignment]


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    expires_at: datetime | None = None


class Rotation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    overlap_s: float = Field(0.0, ge=0, le=MAX_OVERLAP_S)  # 0: the old key ends now


def install(app: FastAPI, deps: Deps) -> None:
    tenants = Tenants(deps.store)
    routes = _Routes(deps, tenants)
    hidden: dict[str, Any] = {"dependencies": [Depends(check_headers)],
                              "include_in_schema": False}
    base = "/admin/v1/tenants"
    app.get(base, **hidden)(routes.list_tenants)
    app.post(base, status_code=201, **hidden)(routes.create_tenant)
    app.get(base + "/{name}", **hidden)(routes.get_tenant)
    app.patch(base + "/{name}", **hidden)(routes.update_tenant)
    app.delete(base + "/{name}", **hidden)(routes.revoke_tenant)
    app.post(base + "/{name}/keys", status_code=201, **hidden)(routes.add_key)
    app.post(base + "/{name}/keys/{key_id}/rotate", status_code=201, **hidden)(routes.rotate_key)
    app.delete(base + "/{name}/keys/{key_id}", **hidden)(routes.revoke_key)


async def require_admin(tenants: Tenants, request: Request) -> None:
    """401 unless the request's bearer key is an admin key."""
    key = bearer_key(request)
    if not await asyncio.to_thread(tenants.is_admin_key, key):
        raise unauthorized("authorization: not an admin key (`tidegate admin-key create`)")


class _Routes:
    def __init__(self, deps: Deps, tenants: Tenants) -> None:
        self.deps, self.tenants = deps, tenants

    async def _admin(self, request: Request) -> None:
        await require_admin(self.tenants, request)

    async def _body(self, request: Request, model: type[M]) -> M:
        body = await json_body(request, self.deps)
        check_text(body)
        try:
            # Strict, as JSON has its types: `false` is not 0 and a number is not a date
            # (found by tests/stack/test_fuzz.py); a date is an ISO 8601 string.
            return model.model_validate_json(json.dumps(body), strict=True)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "body"
            raise bad_request(field, f"{field}: {err['msg']}") from None

    async def _tenant(self, name: str) -> TenantRecord:
        record = await asyncio.to_thread(self.tenants.get, name)
        if record is None:
            raise not_found("tenant")
        return record

    def _check(self, settings: TenantSettings) -> None:
        unknown = sorted(set(settings.lanes or ()) - set(self.deps.settings.lanes))
        if unknown:
            raise bad_request("lanes", f"lanes: unknown lanes {unknown}; lanes are "
                              f"{sorted(self.deps.settings.lanes)}")
        if settings.webhook_url is not None:
            try:
                check_url(settings.webhook_url, self.deps.settings)
            except UrlMalformed as exc:
                raise malformed("webhook_url", f"webhook_url: {exc}") from None
            except UrlRefused as exc:
                raise bad_request("webhook_url", f"webhook_url: {exc}") from None

    def _changed(self) -> None:
        announce_change(self.deps.sync_redis, self.deps.settings.namespace)

    async def list_tenants(self, request: Request) -> JSONResponse:
        await self._admin(request)
        rows = await asyncio.to_thread(self.deps.store.tenants.list_tenants)
        return JSONResponse({"object": "list", "data": [tenant_json(t) for t in rows]})

    async def create_tenant(self, request: Request) -> JSONResponse:
        await self._admin(request)
        new: NewTenant = await self._body(request, NewTenant)
        self._check(new)
        try:
            record, key = await asyncio.to_thread(
                self.deps.store.tenants.create_tenant, new.name, new.lanes, new.requests_per_minute,
                new.tokens_per_minute, new.max_priority)
        except TenantExistsError:
            raise ApiError(409, "name", f"name: tenant {new.name!r} exists",
                           kind="conflict") from None
        later = {name: value for name, value in (("webhook_url", new.webhook_url),
                 ("monthly_token_budget", new.monthly_token_budget),
                 ("fair_weight", new.fair_weight)) if value is not None}
        if later:
            updated = await asyncio.to_thread(self.tenants.update, new.name, **later)
            record = updated or record
        keys = await asyncio.to_thread(self.tenants.keys_of, record.id)
        return JSONResponse({**tenant_json(record), "key": {**key_json(keys[0]), "secret": key}},
                            status_code=201)

    async def get_tenant(self, name: str, request: Request) -> JSONResponse:
        await self._admin(request)
        record = await self._tenant(name)
        keys = await asyncio.to_thread(self.tenants.keys_of, record.id)
        return JSONResponse({**tenant_json(record), "keys": [key_json(k) for k in keys]})

    async def update_tenant(self, name: str, request: Request) -> JSONResponse:
        await self._admin(request)
        await self._tenant(name)
        change: TenantSettings = await self._body(request, TenantSettings)
        self._check(change)
        values = change.model_dump(exclude_unset=True)
        if "lanes" in values and values["lanes"] is None:  # null clears a limit, not the lanes
            raise bad_request("lanes", "lanes: a tenant keeps one lane or more; not null")
        record = await asyncio.to_thread(self.tenants.update, name, **values)
        if record is None:
            raise not_found("tenant")
        self._changed()
        return JSONResponse(tenant_json(record))

    async def revoke_tenant(self, name: str, request: Request) -> JSONResponse:
        await self._admin(request)
        await asyncio.to_thread(self.deps.store.tenants.revoke_tenant, name)
        self._changed()
        return JSONResponse(tenant_json(await self._tenant(name)))

    async def add_key(self, name: str, request: Request) -> JSONResponse:
        await self._admin(request)
        record = await self._tenant(name)
        new: NewKey = await self._body(request, NewKey)
        if new.expires_at is not None and new.expires_at.tzinfo is None:
            raise bad_request("expires_at", "expires_at: give a timezone (ISO 8601)")
        key, secret = await asyncio.to_thread(self.tenants.add_key, record.id, new.name,
                                              new.expires_at)
        return JSONResponse({**key_json(key), "secret": secret}, status_code=201)

    async def rotate_key(self, name: str, key_id: str, request: Request) -> JSONResponse:
        await self._admin(request)
        record = await self._tenant(name)
        rotation: Rotation = await self._body(request, Rotation)
        done = await asyncio.to_thread(self.tenants.rotate_key, record.id, _key_id(key_id),
                                       timedelta(seconds=rotation.overlap_s))
        if done is None:
            raise not_found("key")
        self._changed()
        key, secret = done
        return JSONResponse({**key_json(key), "secret": secret}, status_code=201)

    async def revoke_key(self, name: str, key_id: str, request: Request) -> JSONResponse:
        await self._admin(request)
        record = await self._tenant(name)
        key = await asyncio.to_thread(self.tenants.revoke_key, record.id, _key_id(key_id))
        if key is None:
            raise not_found("key")
        self._changed()
        return JSONResponse(key_json(key))


def _key_id(raw: str) -> int:
    if not (raw.isascii() and raw.isdigit() and len(raw) < 12):
        raise not_found("key")
    return int(raw)


def _at(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def tenant_json(t: TenantRecord) -> JSONObject:
    return {"id": t.id, "name": t.name, "lanes": list(t.lanes), "active": t.active,
            "created_at": _at(t.created_at), "revoked_at": _at(t.revoked_at),
            "requests_per_minute": t.requests_per_minute,
            "tokens_per_minute": t.tokens_per_minute, "webhook_url": t.webhook_url,
            "max_priority": t.max_priority, "monthly_token_budget": t.monthly_token_budget,
            "fair_weight": t.fair_weight or 1}


def key_json(k: KeyRecord) -> JSONObject:
    return {"id": k.id, "name": k.name, "active": k.active, "created_at": _at(k.created_at),
            "last_used_at": _at(k.last_used_at), "expires_at": _at(k.expires_at),
            "revoked_at": _at(k.revoked_at)}
