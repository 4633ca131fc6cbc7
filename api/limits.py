"""The bounds a submit meets before anything is written, each a 429 with Retry-After.

- Rate limits per tenant: requests and tokens per minute, sliding windows in Redis (the
  `limits` library: tidegate/ratelimit.py), so every API replica counts against the same
  budget; a job is charged prompt plus max_tokens, and its worker gives back the
  max_tokens it did not generate when the job ends.
- A monthly token budget per tenant: the month's tokens as the usage ledger counts them
  (store/usage.py), read at most every USAGE_FRESH_S per tenant (MonthUsage); spent, a
  submit is refused with 429 `quota_exceeded` until the month ends.
- Queue depth per lane: the messages waiting in the lane's pool queues (counted anyway,
  for the router). Jobs below the lane's default priority meet a lower bound, so under a
  flood the least urgent are shed first and the lane keeps room for its normal and
  urgent work.
- Jobs in flight per tenant (queued or running): counted by the store, the truth, on an
  index of (tenant, status), so the count reads at most the cap's index entries and never
  drifts; a Redis counter would need every path that ends a job (worker, cancel, expiry,
  reconciler, a Redis restart) to decrement it exactly once. Each API process reads a
  tenant's count at most every IN_FLIGHT_FRESH_S and adds the jobs it admitted since
  (InFlightCounts): the count was a fifth of a submit's CPU when read on every one.

- The lane's queue depth is read the same way (Backlogs): at most every BACKLOG_FRESH_S
  per lane, plus the jobs this process queued there since; the read (LLEN of ten priority
  lists per pool queue, a Redis round trip) was 7% of a submit's CPU.

Both caps are read, then the job written: concurrent submits can pass a bound by the
number of admission threads. They are load bounds, not quotas.

Each of the three reads runs behind the submits once its value is past its freshness
(Refresher): a value up to STALE_GRACE_S older answers the submit while one thread reads
the new one. Read inline, every such read was one more round trip a submit waited on, and
under load (a busy event loop holding the GIL, a busy store) the one that took its p99
from 10 to 33 ms (bench/noisy_neighbour.py). Older than that (an idle tenant, a store that
stopped answering), the submit reads inline, as before, and gets its 503.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Hashable
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from api.errors import ApiError, over_limit
from tidegate import keys, ratelimit
from tidegate.lanes import Lane

if TYPE_CHECKING:  # api.auth reads the HTTP request: api/submit.py charges without FastAPI
    from api.auth import Tenant

log = logging.getLogger(__name__)

STALE_GRACE_S = 1.0  # past its freshness, how much older a value may answer a submit


class Refresher:
    """Reads run behind the submits, on one thread, one at a time, each key at most once
    waiting. A read that fails is dropped: the value goes on ageing, and past its grace the
    next submit reads it inline (and meets the failure itself)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: set[Hashable] = set()
        self._reads: queue.SimpleQueue[tuple[Hashable, Callable[[], object]]] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None

    def ask(self, key: Hashable, read: Callable[[], object]) -> None:
        with self._lock:
            if key in self._waiting:
                return
            self._waiting.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="api-refresher",
                                                daemon=True)
                self._thread.start()
        self._reads.put((key, read))

    def _run(self) -> None:
        while True:
            key, read = self._reads.get()
            try:
                read()
            except Exception as exc:  # noqa: BLE001 - the submits read inline past the grace
                log.debug("a read behind the submits failed (%s)", type(exc).__name__)
            finally:
                with self._lock:
                    self._waiting.discard(key)


def cached(age: float, fresh_s: float, behind: Refresher | None) -> bool:
    """Whether a value `age` seconds old answers: fresh, or within its grace with a
    refresher to read the next one."""
    return age <= fresh_s or (behind is not None and age <= fresh_s + STALE_GRACE_S)


def _limits(tenant: Tenant, tokens: int) -> list[tuple[str, int, int]]:
    """The tenant's per-minute limits: (kind, limit, what this request costs)."""
    out = []
    if tenant.requests_per_minute is not None:
        out.append((ratelimit.REQUESTS, tenant.requests_per_minute, 1))
    if tenant.tokens_per_minute is not None:
        out.append((ratelimit.TOKENS, tenant.tokens_per_minute, tokens))
    return out


def charge(limiter: ratelimit.RateLimits, tenant: Tenant, tokens: int) -> dict[str, str]:
    """Counts one request of `tokens` (prompt plus max_tokens) or raises 429; the
    x-ratelimit-* headers of the tenant's limits as they then stand (none without limits).
    A request the token limit refuses has counted against the request limit (a request
    made), not the token one."""
    charged = _limits(tenant, tokens)
    for kind, limit, cost in charged:
        if not limiter.hit(kind, tenant.id, limit, cost):
            raise _limited(limiter, tenant, kind, limit)
    return rate_headers({kind: limiter.window(kind, tenant.id, limit)
                         for kind, limit, _ in charged})


def rate_headers(windows: dict[str, ratelimit.Window]) -> dict[str, str]:
    """OpenAI's rate limit headers (x-ratelimit-limit-requests, ...-remaining-tokens,
    ...-reset-tokens as `6m0s`), for the limits in `windows`."""
    headers = {}
    for kind, window in windows.items():
        headers[f"x-ratelimit-limit-{kind}"] = str(window.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(window.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = ratelimit.duration(window.reset_s)
    return headers


def _limited(limiter: ratelimit.RateLimits, tenant: Tenant, kind: str, limit: int) -> ApiError:
    windows = {k: limiter.window(k, tenant.id, lim) for k, lim, _ in _limits(tenant, 0)}
    # The whole window's reset is the honest bound: how much frees sooner depends on the
    # charges in it, which the counters do not keep apart.
    retry_after = max(1, math.ceil(windows[kind].reset_s))
    what = ("prompt plus max_tokens " if kind == ratelimit.TOKENS else "") + kind
    return ApiError(429, None, f"rate limit: this API key may send {limit} {what} per "
                    f"minute; retry in {retry_after} s", kind="rate_limited",
                    headers={"Retry-After": str(retry_after), **rate_headers(windows)})


USAGE_FRESH_S = 2.0  # how old a tenant's month of usage may be when a submit reads it


def check_budget(tenant: Tenant, used: Callable[[int], int]) -> None:
    """Raises 429 `quota_exceeded` when the tenant's month (UTC) of tokens, `used(id)`, has
    reached its monthly_token_budget; the retry hint is the next month's start."""
    budget = tenant.monthly_token_budget
    if budget is None:
        return
    spent = used(tenant.id)
    if spent >= budget:
        # x-should-retry: false, as api/files.py's quotas: the openai SDK retries a 429, and
        # waiting seconds frees nothing here.
        raise ApiError(429, None, f"quota exceeded: this API key's tenant has used {spent} "
                       f"of its {budget} tokens this month (UTC); it may submit again next "
                       f"month, or when an admin raises monthly_token_budget",
                       kind="quota_exceeded",
                       headers={"Retry-After": str(_to_next_month_s()),
                                "x-should-retry": "false"})


def month_start(today: date) -> date:
    return today.replace(day=1)


def _to_next_month_s() -> int:
    now = datetime.now(UTC)
    first = month_start(now.date())
    following = (first + timedelta(days=32)).replace(day=1)
    start = datetime(following.year, following.month, 1, tzinfo=UTC)
    return max(1, math.ceil((start - now).total_seconds()))


class MonthUsage:
    """A tenant's tokens this month (UTC), as `read(tenant_id, first_day)` (the ledger)
    says, read at most every `fresh_s` per tenant: a budget errs by what ended in that
    time (and by the jobs in flight, counted when they end), which a budget of tokens per
    month can take; a read per submit cannot be."""

    def __init__(self, read: Callable[[int, date], int], fresh_s: float = USAGE_FRESH_S,
                 behind: Refresher | None = None) -> None:
        self._read = read
        self._fresh_s, self._behind = fresh_s, behind
        self._lock = threading.Lock()
        self._known: dict[int, tuple[float, date, int]] = {}  # tenant -> (at, month, tokens)

    def get(self, tenant_id: int) -> int:
        now, month = time.monotonic(), month_start(datetime.now(UTC).date())
        with self._lock:
            read_at, known_month, tokens = self._known.get(tenant_id, (-1e9, month, 0))
        if known_month == month and cached(now - read_at, self._fresh_s, self._behind):
            if now - read_at > self._fresh_s and self._behind is not None:
                self._behind.ask(("usage", tenant_id), lambda: self._refresh(tenant_id, month))
            return tokens
        return self._refresh(tenant_id, month)

    def _refresh(self, tenant_id: int, month: date) -> int:
        now = time.monotonic()
        tokens = self._read(tenant_id, month)
        with self._lock:
            self._known[tenant_id] = (now, month, tokens)
        return tokens


async def check_upload_budget(client: aioredis.Redis, namespace: str, tenant_id: int,
                              per_minute: int) -> None:
    """429 before an upload is read when the tenant's upload bytes this minute are spent
    (async: the upload route's Redis is the API's asyncio client). An upload is charged
    what was read of it, refused or not, by `charge_upload` when it ends; so a tenant
    passes its budget by at most one upload (TIDEGATE_BATCH_MAX_FILE_BYTES)."""
    now = time.time()
    key = keys.rate_window(namespace, tenant_id, int(now // 60), "upload_bytes")
    used = int(await client.get(key) or 0)
    if used >= per_minute:
        retry_after = 60 - int(now % 60)
        raise ApiError(429, "file", f"rate limit: this tenant may upload {per_minute} bytes "
                       f"a minute (TIDEGATE_TENANT_UPLOAD_BYTES_PER_MINUTE); retry in "
                       f"{retry_after} s", kind="rate_limited",
                       headers={"Retry-After": str(retry_after), "Connection": "close"})


async def charge_upload(client: aioredis.Redis, namespace: str, tenant_id: int,
                        read: int) -> None:
    key = keys.rate_window(namespace, tenant_id, int(time.time() // 60), "upload_bytes")
    pipe = client.pipeline(transaction=True)
    pipe.incrby(key, read)
    pipe.expire(key, keys.RATE_WINDOW_TTL_S)
    await pipe.execute()


RETRY_AFTER_FULL_S = 5  # a full lane drains, or a tenant's jobs end, in seconds at a peak


def depth_limit(cap: int, priority: int, default_priority: int) -> int:
    """The queue depth from which a job of `priority` is refused: the cap at the lane's
    default priority and above; below it, linearly less, down to half the cap at 0."""
    if priority >= default_priority:
        return cap
    return max(1, cap * (default_priority + priority) // (2 * default_priority))


def check_queue_depth(lane: Lane, default_cap: int, priority: int, depth: int) -> None:
    """Raises 429 `queue_full` when `depth` messages wait in the lane's pool queues."""
    cap = lane.max_queue_depth or default_cap
    limit = depth_limit(cap, priority, lane.default_priority)
    if depth >= limit:
        below = (f" (priority {priority}, below the lane's default, from {limit})"
                 if limit < cap else "")
        raise over_limit("queue_full", f"queue full: lane {lane.name!r} has {depth} jobs "
                         f"waiting; it takes at most {cap}{below}; retry in "
                         f"{RETRY_AFTER_FULL_S} s", RETRY_AFTER_FULL_S)


def check_in_flight(in_flight: int, cap: int) -> None:
    """Raises 429 `too_many_in_flight` when the tenant has `cap` jobs queued or running."""
    if in_flight >= cap:
        raise over_limit("too_many_in_flight", f"too many jobs in flight: this API key has "
                         f"{in_flight} jobs queued or running, at most {cap}; retry when "
                         f"some have ended", RETRY_AFTER_FULL_S)


IN_FLIGHT_FRESH_S = 0.25  # how old a tenant's count of jobs in flight may be


class InFlightCounts:
    """A tenant's jobs in flight, as `count` (the store) says, read at most every
    `fresh_s` per tenant, plus the jobs this process admitted since. A job that ended
    meanwhile keeps its place until the next read (at most `fresh_s`), so the cap errs on
    the side of refusing; a cancel through this process gives the place back at once."""

    def __init__(self, count: Callable[[int], int], fresh_s: float = IN_FLIGHT_FRESH_S,
                 behind: Refresher | None = None) -> None:
        self._count = count
        self._fresh_s, self._behind = fresh_s, behind
        self._lock = threading.Lock()
        self._known: dict[int, tuple[float, int]] = {}  # tenant -> (read at, count)

    def get(self, tenant_id: int) -> int:
        now = time.monotonic()
        with self._lock:
            read_at, known = self._known.get(tenant_id, (-1e9, 0))
        if cached(now - read_at, self._fresh_s, self._behind):
            if now - read_at > self._fresh_s and self._behind is not None:
                self._behind.ask(("in_flight", tenant_id), lambda: self._refresh(tenant_id))
            return known
        return self._refresh(tenant_id)

    def _refresh(self, tenant_id: int) -> int:
        """The store's count; the jobs admitted here while it was read are in it or will
        be seen at the next read (a load bound: it errs by what raced the read)."""
        now = time.monotonic()
        counted = self._count(tenant_id)
        with self._lock:
            self._known[tenant_id] = (now, counted)
        return counted

    def admitted(self, tenant_id: int) -> None:
        with self._lock:
            read_at, known = self._known.get(tenant_id, (-1e9, 0))
            self._known[tenant_id] = (read_at, known + 1)

    def forget(self, tenant_id: int) -> None:
        """The next get() reads the store (a job of the tenant ended here)."""
        with self._lock:
            self._known.pop(tenant_id, None)


BACKLOG_FRESH_S = 0.05  # how old a lane's queue depths may be


class Backlogs:
    """The messages waiting in each of a lane's pool queues, as `read(queues)` (Redis) says,
    read at most every `fresh_s` per lane, plus the jobs this process queued since
    (`queued`). The depth bound keeps its meaning: what this process adds is counted at
    once, exactly; what the workers take meanwhile is seen at the next read (at most
    `fresh_s` later), so near the cap the bound errs on the side of refusing; what other
    API processes add is seen at the next read too, which lets a lane pass its cap by their
    admissions in `fresh_s` at most (a load bound, as above). The router's estimates read
    the same numbers."""

    def __init__(self, read: Callable[[list[str]], dict[str, int]],
                 fresh_s: float = BACKLOG_FRESH_S, behind: Refresher | None = None) -> None:
        self._read = read
        self._fresh_s, self._behind = fresh_s, behind
        self._lock = threading.Lock()
        self._known: dict[tuple[str, ...], tuple[float, dict[str, int]]] = {}

    def get(self, queues: list[str]) -> dict[str, int]:
        """Messages waiting per queue of `queues` (one lane's pool queues)."""
        lane = tuple(queues)
        now = time.monotonic()
        with self._lock:
            read_at, known = self._known.get(lane, (-1e9, {}))
            if cached(now - read_at, self._fresh_s, self._behind):
                if now - read_at > self._fresh_s and self._behind is not None:
                    self._behind.ask(("backlog", lane), lambda: self._refresh(queues))
                return dict(known)
        return self._refresh(queues)

    def _refresh(self, queues: list[str]) -> dict[str, int]:
        now = time.monotonic()
        counted = self._read(queues)
        with self._lock:
            self._known[tuple(queues)] = (now, counted)
        return dict(counted)

    def forget(self) -> None:
        """The next get() reads Redis for every lane (its queues were emptied elsewhere)."""
        with self._lock:
            self._known.clear()

    def queued(self, queue: str) -> None:
        """This process put one message on `queue`."""
        with self._lock:
            for _, known in self._known.values():
                if queue in known:
                    known[queue] += 1
