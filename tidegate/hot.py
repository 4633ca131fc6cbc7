"""A lane's hot prefixes: the rendered system prompts of its recent traffic, ranked by
use, which the scheduler warms into a worker it activates (scheduler/autoscale.py). The
API records them, the scheduler reads them: both sides of one Redis layout, in the core.

They are tenants' text, so none outlives its last use by more than `hot_prefix_ttl_s`:
each prefix is a string key of its own, rewritten with that TTL on every use, so Redis
itself drops it on time. The lane's ranking is a sorted set of digests, never of text:
it keeps the `HOT_PREFIXES_KEPT` most used and expires with the lane's last recorded use;
a digest whose text has expired is dropped when the ranking is read.

Only a lane that shares its prefix cache records any (Lane.share_prefix_cache): warm-ups
carry no tenant's salt, so on an isolated lane no request could hit them, and keeping
tenants' system prompts would serve nothing.
"""

from __future__ import annotations

import hashlib
from typing import cast

import redis
from redis.client import Pipeline

from tidegate import keys


def record(pipe: Pipeline, ns: str, lane: str, prefix: str, ttl_s: int) -> None:
    """Count one use of `prefix` on `lane`, on a Redis pipeline the caller executes."""
    digest = hashlib.sha256(prefix.encode()).hexdigest()
    ranking = keys.hot_prefixes(ns, lane)
    pipe.set(keys.hot_prefix_text(ns, lane, digest), prefix, ex=ttl_s)
    pipe.zincrby(ranking, 1, digest)
    pipe.zremrangebyrank(ranking, 0, -(keys.HOT_PREFIXES_KEPT + 1))
    pipe.expire(ranking, ttl_s)


def read(client: redis.Redis, ns: str, lane: str, count: int) -> list[str]:
    """The lane's `count` most used prefixes that have not expired, most used first."""
    ranking = keys.hot_prefixes(ns, lane)
    digests = [_text(d) for d in cast(list[bytes | str], client.zrevrange(ranking, 0, -1))]
    if not digests:
        return []
    texts = cast(list[bytes | str | None],
                 client.mget([keys.hot_prefix_text(ns, lane, d) for d in digests]))
    expired = [d for d, text in zip(digests, texts, strict=True) if text is None]
    if expired:
        client.zrem(ranking, *expired)
    return [_text(t) for t in texts if t is not None][:count]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
