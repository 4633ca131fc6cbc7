"""Bearer API keys: a tenant is whoever holds a key whose hash is stored and not revoked."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from api.errors import unauthorized
from store import Store
from tidegate import keys

log = logging.getLogger("tidegate.api")


@dataclass(frozen=True)
class Tenant:
    id: int
    name: str
    lanes: frozenset[str]
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    webhook_url: str | None = None  # its jobs' default callback_url


async def authenticate(store: Store, request: Request) -> Tenant:
    return await asyncio.to_thread(tenant_for_key, store, bearer_key(request))


def bearer_key(request: Request) -> str:
    """The request's API key; 401 when it carries none (no store lookup)."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("authorization: missing `Authorization: Bearer <API key>` header")
    return key.strip()


# A key found valid is trusted this long without a store lookup: every request began with
# one, and after an API restart hundreds of reconnecting streams queued behind them. The
# cost: a revoked key keeps working this long on a process that had just used it.
KEY_CACHE_S = 5.0
KEY_CACHE_MAX = 10_000


class _KnownKeys:
    """Valid keys seen lately (by digest, never the key itself), with when they were seen.
    Unknown keys are never cached: each is a lookup, as before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, Tenant]] = {}

    def get(self, digest: str) -> Tenant | None:
        with self._lock:
            hit = self._seen.get(digest)
        if hit is None or time.monotonic() - hit[0] > KEY_CACHE_S:
            return None
        return hit[1]

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()

    def put(self, digest: str, tenant: Tenant) -> None:
        with self._lock:
            if len(self._seen) >= KEY_CACHE_MAX:
                self._seen.clear()  # rare (that many keys in 5 s): start over, stay bounded
            self._seen[digest] = (time.monotonic(), tenant)


_known = _KnownKeys()


def announce_change(client: Any, namespace: str) -> None:
    """A key or tenant changed (revoked, rotated, its lanes or limits): this process and,
    through Redis, every other API process forget the keys they had found valid."""
    _known.clear()
    client.publish(keys.auth_changed_channel(namespace), "1")


async def follow_changes(client: Any, namespace: str) -> None:
    """Forget the valid keys whenever another process announces a change (runs until
    cancelled). A lost message costs at most KEY_CACHE_S: the cache's own limit."""
    while True:
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(keys.auth_changed_channel(namespace))
                _known.clear()  # changes missed while not subscribed
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        _known.clear()
        except Exception as exc:  # Redis went away: subscribe again
            log.warning("auth change follower lost Redis: %s", type(exc).__name__)
            await asyncio.sleep(1)


def tenant_for_key(store: Store, key: str) -> Tenant:
    """The tenant holding `key` (blocking: a store lookup, unless the key was found valid
    in the last KEY_CACHE_S); 401 for an unknown or revoked key."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    if (tenant := _known.get(digest)) is not None:
        return tenant
    record = store.tenant_by_key(key)
    if record is None:
        raise unauthorized("authorization: unknown or revoked API key")
    tenant = Tenant(id=record.id, name=record.name, lanes=frozenset(record.lanes),
                    requests_per_minute=record.requests_per_minute,
                    tokens_per_minute=record.tokens_per_minute,
                    webhook_url=record.webhook_url)
    _known.put(digest, tenant)
    return tenant
