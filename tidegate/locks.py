"""The one lock idiom on Redis: take a key with a token of your own and a TTL; release
(or extend) it only while it still holds your token, in one script, so a holder that
stalled past its TTL never deletes the lock a later holder took.

    lock = RedisLock(client, key, ttl_s=30)
    if lock.acquire():
        try: ...
        finally: lock.release()

    with RedisLock(client, key, ttl_s=30) as held:   # held: bool
        if held: ...

A period lock (one actor per period: `take_period`) never releases; it expires.
"""

from __future__ import annotations

import uuid
from types import TracebackType
from typing import TYPE_CHECKING

import redis

if TYPE_CHECKING:
    from tidegate.redisconn import StreamsClient, StreamsPipeline

# Compare-and-delete: the GET-then-DEL of two calls lets a lock that expired between them
# (and was taken by another holder) be deleted from under its new holder.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


def new_token(owner: str = "") -> str:
    """A holder's token: the owner's name (for people reading Redis) and a random part,
    so two holders in one process are two holders."""
    return f"{owner}/{uuid.uuid4().hex[:12]}" if owner else uuid.uuid4().hex


class RedisLock:
    """One key, one holder at a time, for at most `ttl_s` unless extended."""

    def __init__(self, client: StreamsClient, key: str, ttl_s: float,
                 token: str | None = None) -> None:
        self.client, self.key = client, key
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.token = token or new_token()
        self.held = False

    def acquire(self) -> bool:
        self.held = bool(self.client.set(self.key, self.token, nx=True, px=self.ttl_ms))
        return self.held

    def acquire_in(self, pipe: StreamsPipeline) -> None:
        """acquire() queued on a pipeline (the caller reads the reply)."""
        pipe.set(self.key, self.token, nx=True, px=self.ttl_ms)

    def extend(self) -> bool:
        """Another full TTL, if the lock is still this holder's."""
        self.held = bool(self.client.eval(EXTEND, 1, self.key, self.token, self.ttl_ms))
        return self.held

    def release(self) -> bool:
        """Deletes the lock if it is still this holder's, never another's."""
        released = bool(self.client.eval(RELEASE, 1, self.key, self.token))
        self.held = False
        return released

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.held:
            self.release()


def take_period(client: redis.Redis, key: str, period_s: float, *,
                ttl_s: float | None = None, owner: str = "1") -> bool:
    """True for the one caller that takes `key` first; it expires after two periods (or
    `ttl_s`), so a period is acted on once however many processes ask. `owner`: the value
    left in the key, for people reading Redis."""
    ttl_ms = int((2 * period_s if ttl_s is None else ttl_s) * 1000)
    return bool(client.set(key, owner, nx=True, px=max(1, ttl_ms)))
