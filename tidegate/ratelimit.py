"""Per-minute rate limits per tenant, on Redis: the `limits` library's sliding window counter.

A tenant's requests and tokens per minute are each one limit. The library keeps two
counters per limit (this window's and the last one's) and weighs the last one by how much
of it still lies within the past minute, so a burst at a minute's edge cannot spend two
minutes' budget at once (the fixed one-minute window before it could). Every API replica
counts against the same counters. A submit is charged its prompt plus max_tokens up front
(what it may cost); the worker that ends the job gives back what it did not generate
(`refund`).

Written by the API (charge, read) and the worker (refund); the keys are under
`keys.rate_limits(ns)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis
from limits import RateLimitItemPerMinute
from limits.storage import RedisStorage
from limits.strategies import SlidingWindowCounterRateLimiter

from tidegate import keys

WINDOW_S = 60
REQUESTS, TOKENS = "requests", "tokens"
CLOCK_SLACK_MS = 1000  # the API's clock against Redis's, and the charge before the row

# Gives back up to ARGV[2] tokens to the window counter that holds a charge made at ARGV[3]
# (epoch ms, aged by Redis's clock), never below 0. The library's current counter is set to
# live two windows from its window's start (acquire_sliding_window.lua), so its window
# began 2*expiry - PTTL ago; the counter before it covers the window before that; a charge
# older than both has aged out. ARGV[4] ms of slack go to the current window: the charge's
# time is the job row's enqueued_at, the API's clock, a moment after the charge itself,
# and a charge that opened the window is as old as the window.
_REFUND = """
local expiry = tonumber(ARGV[1])
local current_ttl = redis.call('pttl', KEYS[2])
if current_ttl <= 0 then return 0 end
local current_age = 2 * expiry - current_ttl
local now = redis.call('time')
local age = (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)) - tonumber(ARGV[3])
local key = KEYS[2]
if age > current_age + expiry + tonumber(ARGV[4]) then return 0 end
if age > current_age + tonumber(ARGV[4]) then key = KEYS[1] end
local held = tonumber(redis.call('get', key) or '0')
local back = math.min(held, tonumber(ARGV[2]))
if back > 0 then redis.call('decrby', key, back) end
return back
"""


class _PerMinute(RateLimitItemPerMinute):
    """A limit keyed by tenant and kind only, not by its amount as the library's are: a
    changed limit keeps what its window holds, and a worker refunds without knowing it."""

    def key_for(self, *identifiers: bytes | str | int | float) -> str:
        return "/".join([self.namespace, *(str(part) for part in identifiers)])


@dataclass(frozen=True)
class Window:
    """A limit as a caller sees it (OpenAI's x-ratelimit-* headers)."""

    limit: int
    remaining: int
    reset_s: float  # until the window is back to its whole limit


class RateLimits:
    def __init__(self, client: redis.Redis, namespace: str) -> None:
        """`client`: a redis.Redis (the API's or the worker's, TIDEGATE_REDIS_URL): the
        limiter uses its connection pool, so Sentinel and timeouts are as configured."""
        self._storage = RedisStorage("redis://", connection_pool=client.connection_pool,
                                     key_prefix=keys.rate_limits(namespace))
        self._limiter = SlidingWindowCounterRateLimiter(self._storage)
        self._client, self._namespace = client, namespace

    @staticmethod
    def _item(kind: str, limit: int) -> _PerMinute:
        return _PerMinute(limit, namespace=kind)

    def hit(self, kind: str, tenant_id: int, limit: int, cost: int) -> bool:
        """Charge `cost`; False (and nothing charged) when it would pass `limit`."""
        return self._limiter.hit(self._item(kind, limit), str(tenant_id), cost=cost)

    def window(self, kind: str, tenant_id: int, limit: int) -> Window:
        """What is left of the tenant's limit, and when it is whole again."""
        item = self._item(kind, limit)
        # One read of both counters (the library's get_window_stats is this read and the
        # same weighing, with a reset time of "one more unit", not "whole again").
        before, before_ttl, now, now_ttl = self._storage.get_sliding_window(
            item.key_for(str(tenant_id)), item.get_expiry())
        used = self._limiter._weighted_count(item, before, before_ttl, now)
        # A count weighs until its counter expires (the current one stays whole for the
        # rest of its window, then fades over the next one, as the last one fades now).
        reset = max(now_ttl if now else 0.0, before_ttl if before else 0.0)
        return Window(limit=limit, remaining=max(0, limit - math.floor(used)), reset_s=reset)

    def refund(self, tenant_id: int, tokens: int, charged_at: float) -> int:
        return refund(self._client, self._namespace, tenant_id, tokens, charged_at)


def refund(client: redis.Redis, namespace: str, tenant_id: int, tokens: int,
           charged_at: float) -> int:
    """Give back `tokens` of a charge made at `charged_at` (epoch seconds) to the tenant's
    token window; the tokens given back (0 if the charge aged out, or the tenant has no
    token limit: no counter). One script call on `client`, a redis.Redis of
    TIDEGATE_REDIS_URL (the worker's, which ends the job).

    Safe: it gives back only what the charge took and the job did not use (its max_tokens
    less its completion tokens; the caller says), only to the counter that holds the
    charge, never below zero; and a job is refunded once, by the attempt that ends it (it
    holds the job's lease), so the window never counts less than the jobs in it used."""
    if tokens <= 0:
        return 0
    key = _PerMinute(1, namespace=TOKENS).key_for(str(tenant_id))
    # The library's names for the window's two counters (limits' RedisStorage: its
    # sliding-window keys are `{key}` and `{key}/-1` under its prefix).
    current = f"{keys.rate_limits(namespace)}:{{{key}}}"
    script = client.register_script(_REFUND)  # a Script object: its sha, no round trip
    return int(script(keys=[f"{current}/-1", current],
                      args=[WINDOW_S * 1000, tokens, int(charged_at * 1000),
                            CLOCK_SLACK_MS]) or 0)


def unused_tokens(max_tokens: int | None, completion_tokens: int | None) -> int:
    """What a job's charge (prompt plus max_tokens) took and the job did not generate."""
    return max(0, (max_tokens or 0) - (completion_tokens or 0))


def duration(seconds: float) -> str:
    """A duration as OpenAI writes its reset headers (Go's form): `120ms`, `1s`, `8.64s`,
    `6m0s`, `1h2m3s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    whole_min, secs = divmod(seconds, 60)
    hours, mins = divmod(int(whole_min), 60)
    text = f"{secs:.2f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{mins}m{text}"
    return f"{mins}m{text}" if mins else text
