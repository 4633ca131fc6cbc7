"""Bearer API keys: a tenant is whoever holds a key whose hash is stored and not revoked.

Who may come in is decided on the event loop, before a request's body is read (KeyGate):

- a key found valid lately is answered from memory (KEY_CACHE_S), on the loop;
- a key found unknown lately is a 401 from memory too (UNKNOWN_CACHE_S), bounded in size;
- a client address that earned too many 401s lately gets 429 instead of a lookup
  (FailedAuth), unless its key was found valid before;
- every other key is looked up in the store on an admission thread (api/admission.py):
  a key seen valid before (whose entry is only old, or was made stale by a change) at the
  top, a key never seen valid last, behind every tenant's submit, with a cap of its own.

Revoking a key or a tenant (api/admin.py) is announced to every API process: each one
forgets what it knew valid (a generation counter, so a lookup that was in flight when the
change came is not cached as valid after it), and ends the event streams opened with a
key now refused (OpenStreams).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import cachetools
import redis as syncredis
import redis.asyncio as aioredis
from fastapi import Request
from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import FixedWindowRateLimiter

from api.admission import Admission
from api.errors import ApiError, over_limit, unauthorized
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
    max_priority: int | None = None  # the most its jobs may ask; None: the lane's default
    monthly_token_budget: int | None = None  # tokens a month (UTC); None: no budget
    fair_weight: int = 1  # its share of a backlogged lane against other tenants' weights


# A key found valid is trusted this long without a store lookup: every request began with
# one, and after an API restart hundreds of reconnecting streams queued behind them. A
# revocation announced ends the trust at once (_KnownKeys.clear).
KEY_CACHE_S = 5.0
KEY_CACHE_MAX = 10_000
# A key found unknown is refused this long without a lookup: a caller that repeats a wrong
# key costs nothing after the first. Keys are made valid from birth (a new random secret),
# so no key the store would accept is ever remembered here.
UNKNOWN_CACHE_S = 10.0
UNKNOWN_CACHE_MAX = 10_000
# Admission ranks (api/admission.py, lower first). A key seen valid before is checked
# ahead of every submit: one indexed read that gates a tenant's request. A key never seen
# valid waits behind everything (an unknown caller waits behind tenants).
KEY_CHECK_RANK = (-2.0,)
UNKNOWN_CALLER_RANK = (1e9,)
UNKNOWN_KEY = "authorization: unknown or revoked API key"
MISSING_KEY = "authorization: missing `Authorization: Bearer <API key>` header"
CHANGES_POLL_S = 1.0  # follow_changes waits this long for a message per call


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class _KnownKeys:
    """Keys found valid (by digest, never the key itself): when, and in which generation.
    An entry is fresh for KEY_CACHE_S within its generation; an older one still says that
    the key was valid once, which ranks its next lookup as a tenant's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int, Tenant]] = {}
        self.generation = 0  # bumped by every change announced

    def get(self, digest: str) -> tuple[Tenant | None, bool]:
        """(the tenant last found for the key or None, whether that is fresh)."""
        with self._lock:
            hit, generation = self._seen.get(digest), self.generation
        if hit is None:
            return None, False
        checked_at, seen_in, tenant = hit
        return tenant, seen_in == generation and time.monotonic() - checked_at <= KEY_CACHE_S

    def put(self, digest: str, tenant: Tenant, generation: int) -> None:
        """Remembers a lookup's answer, unless a change was announced since the lookup
        began (`generation`): a key revoked meanwhile would be trusted again."""
        with self._lock:
            if generation != self.generation:
                return
            if len(self._seen) >= KEY_CACHE_MAX and digest not in self._seen:
                self._seen.clear()  # rare (that many keys): start over, stay bounded
            self._seen[digest] = (time.monotonic(), generation, tenant)

    def forget(self, digest: str) -> None:
        with self._lock:
            self._seen.pop(digest, None)

    def clear(self) -> None:
        """Nothing found so far is fresh: each key is looked up again at its next use."""
        with self._lock:
            self.generation += 1


class _UnknownKeys:
    """Keys the store refused lately (digests), at most UNKNOWN_CACHE_MAX, each for
    UNKNOWN_CACHE_S (cachetools' TTLCache: a well-kept bounded cache; it needs a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: cachetools.TTLCache[str, bool] = cachetools.TTLCache(
            maxsize=UNKNOWN_CACHE_MAX, ttl=UNKNOWN_CACHE_S, timer=time.monotonic)

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._keys

    def add(self, digest: str) -> None:
        with self._lock:
            self._keys[digest] = True


class FailedAuth:
    """401s answered per client address, counted by the `limits` library in this process's
    memory (fixed windows). In memory, not in Redis: an unknown caller must cost no round
    trip to the Redis every tenant shares, and Redis being down must not turn 401s into
    503s. So each API process counts its own: behind N processes an address gets up to N
    times the limit, which still bounds what it costs each one."""

    def __init__(self, limit: int, window_s: int) -> None:
        self._item = RateLimitItemPerSecond(limit, window_s)
        self._limiter = FixedWindowRateLimiter(MemoryStorage())

    def refusal(self, client: str) -> ApiError | None:
        """The 429 `auth_failures` when `client` has had its 401s for this window."""
        if self._limiter.test(self._item, client):
            return None
        reset_at, _ = self._limiter.get_window_stats(self._item, client)
        retry_after = max(1, math.ceil(reset_at - time.time()))
        return over_limit("auth_failures", f"too many requests with a missing or unknown "
                          f"API key from this address: at most {self._item.amount} in "
                          f"{self._item.get_expiry()} s; retry in {retry_after} s", retry_after)

    def count(self, client: str) -> None:
        """One more 401 answered to `client`."""
        self._limiter.hit(self._item, client)


# Per process, as the keys are: every app in it shares them.
_known = _KnownKeys()
_unknown = _UnknownKeys()


def _bearer(header: str) -> str | None:
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def bearer_key(request: Request) -> str:
    """The request's API key; 401 when it carries none (no store lookup)."""
    key = _bearer(request.headers.get("authorization", ""))
    if key is None:
        raise unauthorized(MISSING_KEY)
    return key


def tenant_for_key(store: Store, key: str) -> Tenant:
    """The tenant holding `key` (blocking: a store lookup, unless the key was found valid
    in the last KEY_CACHE_S, or unknown in the last UNKNOWN_CACHE_S); 401 for an unknown
    or revoked key."""
    digest = key_digest(key)
    tenant, fresh = _known.get(digest)
    if fresh and tenant is not None:
        return tenant
    if digest in _unknown:
        raise unauthorized(UNKNOWN_KEY)
    generation = _known.generation  # read before the lookup: a change after it wins
    record = store.tenants.tenant_by_key(key)
    if record is None:
        _known.forget(digest)
        _unknown.add(digest)
        raise unauthorized(UNKNOWN_KEY)
    tenant = Tenant(id=record.id, name=record.name, lanes=frozenset(record.lanes),
                    requests_per_minute=record.requests_per_minute,
                    tokens_per_minute=record.tokens_per_minute,
                    webhook_url=record.webhook_url, max_priority=record.max_priority,
                    monthly_token_budget=record.monthly_token_budget,
                    fair_weight=record.fair_weight or 1)
    _known.put(digest, tenant, generation)
    return tenant


class KeyGate:
    """The front door's check of a request's key, on the event loop, before its body is
    read (the module's docstring says in what order)."""

    def __init__(self, admission: Admission, failures: FailedAuth) -> None:
        self.admission, self.failures = admission, failures

    def refusal(self, client: str, authorization: str) -> ApiError | None:
        """What needs no lookup to refuse (None: look the key up): no key, a key refused
        lately, or a key never seen valid from an address past its 401s. Counts the 401s
        it answers. The front door (FrontGate) asks this before FastAPI runs."""
        key = _bearer(authorization)
        if key is None:
            return self._failed(client, unauthorized(MISSING_KEY))
        digest = key_digest(key)
        tenant, _ = _known.get(digest)
        if tenant is not None:  # seen valid here: never held back
            return None
        if digest in _unknown:
            return self._failed(client, unauthorized(UNKNOWN_KEY))
        return self.failures.refusal(client)

    def _failed(self, client: str, refused: ApiError) -> ApiError:
        over = self.failures.refusal(client)
        if over is not None:
            return over
        self.failures.count(client)
        return refused

    async def tenant(self, store: Store, request: Request) -> Tenant:
        client = request.client.host if request.client else "-"
        refused = self.refusal(client, request.headers.get("authorization", ""))
        if refused is not None:
            raise refused
        key = bearer_key(request)
        digest = key_digest(key)
        tenant, fresh = _known.get(digest)
        if fresh and tenant is not None:
            return tenant
        rank = KEY_CHECK_RANK if tenant is not None else UNKNOWN_CALLER_RANK
        try:
            return await self.admission.run(rank, tenant_for_key, store, key,
                                            unknown_caller=tenant is None)
        except ApiError as exc:
            if exc.status == 401:
                self.failures.count(client)
            raise


async def authenticate(store: Store, request: Request) -> Tenant:
    """The request's tenant, or 401 (429 for an address that earned too many 401s); call it
    before the body is read. Through the app's KeyGate; on a thread without one."""
    deps = getattr(request.app.state, "deps", None)
    gate: KeyGate | None = getattr(deps, "key_gate", None)
    if gate is None:
        return await asyncio.to_thread(tenant_for_key, store, bearer_key(request))
    return await gate.tenant(store, request)


class OpenStreams:
    """The event streams open in this process, each with the API key it was opened with
    and the function that ends it. After a change is announced every such key is checked
    again (one lookup per key, on threads), and the streams of a key now refused end."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._open: dict[int, tuple[str, Callable[[], None]]] = {}
        self._ids = itertools.count()
        self._checks: set[asyncio.Task[None]] = set()  # held: the loop keeps weak refs

    def add(self, key: str, end: Callable[[], None]) -> Callable[[], None]:
        """Registers a stream (on the event loop); returns what unregisters it."""
        stream_id = next(self._ids)
        self._open[stream_id] = (key, end)

        def remove() -> None:
            self._open.pop(stream_id, None)

        return remove

    def count(self) -> int:
        return len(self._open)

    def changed(self) -> None:
        """A change was announced: check the open streams' keys (from the event loop)."""
        if not self._open:
            return
        task = asyncio.get_running_loop().create_task(self._recheck())
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _recheck(self) -> None:
        by_key: dict[str, list[Callable[[], None]]] = {}
        for key, end in list(self._open.values()):
            by_key.setdefault(key, []).append(end)
        refused = await asyncio.gather(*(self._refused(key) for key in by_key))
        for key, gone in zip(by_key, refused, strict=True):
            if gone:
                for end in by_key[key]:
                    end()

    async def _refused(self, key: str) -> bool:
        try:
            await asyncio.to_thread(tenant_for_key, self.store, key)
        except ApiError as exc:
            return exc.status == 401
        except Exception as exc:  # the store is down: the streams go on, as requests would
            log.warning("open streams' key check failed (%s)", type(exc).__name__)
        return False


def announce_change(client: syncredis.Redis, namespace: str) -> None:
    """A key or tenant changed (revoked, rotated, its lanes or limits): this process and,
    through Redis, every other API process forget the keys they had found valid (and end
    the streams of keys now refused)."""
    _known.clear()
    client.publish(keys.auth_changed_channel(namespace), "1")


async def follow_changes(client: aioredis.Redis, namespace: str,
                         on_change: Callable[[], None] = lambda: None) -> None:
    """Forget the valid keys, and call `on_change`, whenever a process announces a change
    (runs until cancelled). A lost message costs at most KEY_CACHE_S of trust in a key."""
    while True:
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(keys.auth_changed_channel(namespace))
                _changed(on_change)  # changes missed while not subscribed
                while True:
                    # get_message's own timeout, not listen(): the client's socket
                    # timeout would end an idle listen with TimeoutError every few seconds.
                    message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                       timeout=CHANGES_POLL_S)
                    if message is not None and message.get("type") == "message":
                        _changed(on_change)
        except Exception as exc:  # Redis went away: subscribe again
            log.warning("auth change follower lost Redis: %s", type(exc).__name__)
            await asyncio.sleep(1)


def _changed(on_change: Callable[[], None]) -> None:
    _known.clear()
    on_change()
