"""Bearer API keys: a tenant is whoever holds a key whose hash is stored and not revoked."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from api.errors import unauthorized
from store import Store


@dataclass(frozen=True)
class Tenant:
    id: int
    name: str
    lanes: frozenset[str]
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


async def authenticate(store: Store, request: Request) -> Tenant:
    return await asyncio.to_thread(tenant_for_key, store, bearer_key(request))


def bearer_key(request: Request) -> str:
    """The request's API key; 401 when it carries none (no store lookup)."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("authorization: missing `Authorization: Bearer <API key>` header")
    return key.strip()


def tenant_for_key(store: Store, key: str) -> Tenant:
    """The tenant holding `key` (blocking: a store lookup); 401 for an unknown or revoked
    key."""
    record = store.tenant_by_key(key)
    if record is None:
        raise unauthorized("authorization: unknown or revoked API key")
    return Tenant(id=record.id, name=record.name, lanes=frozenset(record.lanes),
                  requests_per_minute=record.requests_per_minute,
                  tokens_per_minute=record.tokens_per_minute)
