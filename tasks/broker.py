"""The broker's transports: kombu's Redis and Redis Sentinel transports, with one fix that
keeps a worker alive when its broker connection breaks (a Redis restart, a failover).

On a lost connection Celery's consumer first `collect()`s the kombu connection, which
ends by setting the transport's `client` to None, then closes it again
(celery/worker/consumer/consumer.py, `on_connection_error_after_connected`, Celery 5.7).
When the first pass did not close a channel (its close stopped at an earlier channel's
connection error), the second one closes it: the channel rebuilds its Redis pool from
`transport.client` to hand its unacked messages back, and kombu's `_connparams` reads
`None.hostname`. That AttributeError is no connection error, so Celery calls it
unrecoverable and the worker process exits with every job it was running. Measured with
a worker with task events on (`-E`, as tidegate's are): 10 broker losses out of 10 killed
it. The acks of tasks still running on the old channel go through that pool too.

These transports keep the `client` they were built with, so the second close, its restore
and those acks reach the broker's connection settings (and, for Sentinel, the sentinels,
which name the new master). The restore fails with a ConnectionError while Redis is down,
which Celery does ignore; a message it could not hand back stays in the `unacked` hash and
goes back to its queue by tidegate's own recovery (tasks/recovery.py) or kombu's.

The channels also reuse one Redis client per connection pool (`_ReusesClient`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
from kombu import Connection
from kombu.transport import TRANSPORT_ALIASES, _transport_cache
from kombu.transport import redis as kombu_redis

# kombu picks a transport by the broker URL's scheme in TRANSPORT_ALIASES: these schemes
# get the classes below (tasks/app.py imports this module before any connection is made).
ALIASES = {"redis": "tasks.broker:RedisTransport", "rediss": "tasks.broker:RedisTransport",
           "sentinel": "tasks.broker:SentinelTransport"}


def register() -> None:
    """Puts these transports under kombu's own scheme names, so URLs, `as_uri()` and
    Flower still say redis:// or sentinel://."""
    for scheme, path in ALIASES.items():
        TRANSPORT_ALIASES[scheme] = path
        _transport_cache.pop(scheme, None)  # a class resolved before this: resolve again


class _KeepsClient:
    """`client` may be set, never cleared (kombu clears it when it collects a connection)."""

    _client: Connection | None = None

    @property
    def client(self) -> Connection | None:
        return self._client

    @client.setter
    def client(self, value: Connection | None) -> None:
        if value is not None:
            self._client = value


class _ReusesClient:
    """kombu builds a new redis-py client around the channel's pool for every publish of a
    fanout message (each Celery task event) and every ack: 9% of a worker's CPU and 3% of
    the API's under load (bench/README.md). One client per pool does the same: a redis-py
    client is a thin wrapper that takes a connection from its pool per command. A pool
    rebuilt after a broken connection gets a client of its own."""

    _reused: redis.Redis | None = None

    @contextmanager
    def conn_or_acquire(self, client: redis.Redis | None = None) -> Iterator[redis.Redis]:
        if client:
            yield client
            return
        reused = self._reused
        if reused is None or reused.connection_pool is not self.pool:  # type: ignore[attr-defined]
            reused = self._reused = self._create_client()  # type: ignore[attr-defined]
        yield reused


class RedisChannel(_ReusesClient, kombu_redis.Channel):
    """kombu's Redis channel, one client per pool."""


class SentinelChannel(_ReusesClient, kombu_redis.SentinelChannel):
    """kombu's Redis Sentinel channel, one client per pool."""


class RedisTransport(_KeepsClient, kombu_redis.Transport):
    """kombu's Redis transport, `client` kept."""

    Channel = RedisChannel


class SentinelTransport(_KeepsClient, kombu_redis.SentinelTransport):
    """kombu's Redis Sentinel transport, `client` kept."""

    Channel = SentinelChannel


register()
