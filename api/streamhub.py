"""One XREAD for every job stream this API process waits on.

An SSE stream (or a streamed completion) waits for its job's next events. With a blocking
XREAD of its own, every event cost the API a Redis round trip per stream, and each
waiting stream held a pooled connection (bench/README.md). The hub holds one XREAD over
all the streams waited on, each from its cursor, and hands each waiter what came for it.
Entries stay in Redis: a waiter that gave up (its wait ran out) reads them next time
from its own cursor, so nothing handed out can be lost.

A waiter that arrives while the XREAD blocks is not in it: the hub then adds an entry to
its own wake stream, which that XREAD also reads, at most once per XREAD. Waiters that
come back while the hub hands out a reply join the next XREAD without one.

Its cost is per XREAD and per entry, paid by one API process for every stream: so the
XREAD goes out on a connection the hub holds while streams wait, packed from arguments
each waiter brought.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

from redis import asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection, Connection
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError

from tidegate import keys, redisconn

BLOCK_MS = 1000  # one XREAD's longest block; waiters time out on their own before
# A cluster node that fails: how long its tag's hub retries on the layout it reads again
# (a failover takes the cluster's node timeout and a second or two), and how often.
FAILOVER_S = 20.0
FAILOVER_POLL_S = 0.2
NODE_FAILURES = (aioredis.ConnectionError, aioredis.TimeoutError, MovedError, AskError,
                 ClusterDownError, TryAgainError)
WAKE_TTL_S = 60  # the wake stream outlives no API process by long

# A stream entry as redis-py hands it over (XREAD, XREVRANGE): its id, and its fields
# (a job's: `e` the event's JSON as the worker wrote it, `k` its kind).
Entry = tuple[bytes, dict[bytes, bytes]]
# An entry as XREAD's reply holds it: [id, [field, value, ...]] (unpacked as a pair).
RawEntry = tuple[bytes, list[bytes]]
# XREAD's reply: [[key, [entry, ...]], ...] (RESP2), {key: [entry, ...]} (RESP3), or nil
# when the block ran out.
XReadReply = list[tuple[bytes, list[RawEntry]]] | dict[bytes, list[RawEntry]] | None


@dataclass(eq=False)  # waiters are told apart by identity
class _Waiter:
    cursor: tuple[int, int]  # the last entry id it has
    future: asyncio.Future[list[Entry]] = field(repr=False)
    key_arg: bytes = field(repr=False)  # its stream's key and its cursor, as XREAD packs them
    cursor_arg: bytes = field(repr=False)


def _entry_id(raw: str | bytes) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _arg(value: str | bytes) -> bytes:
    """One argument of a command in Redis's protocol (a bulk string)."""
    raw = value.encode() if isinstance(value, str) else value
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


def _cursor_of(waiter: _Waiter) -> tuple[int, int]:
    return waiter.cursor


def _streams(reply: XReadReply) -> Iterable[tuple[bytes, list[RawEntry]]]:
    """(key, entries) of each stream in an XREAD reply: a list (RESP2), a map (RESP3), or
    nil when the block ran out."""
    if isinstance(reply, dict):
        return reply.items()
    return reply or ()


def _entry(raw: RawEntry) -> Entry:
    """(id, fields) from an entry as Redis sends it: [id, [field, value, ...]]."""
    entry_id, flat = raw
    pairs = iter(flat)
    return entry_id, dict(zip(pairs, pairs, strict=True))


def _time_out(future: asyncio.Future[list[Entry]]) -> None:
    if not future.done():
        future.set_result([])  # none came in time; the entries stay in Redis


class StreamHub:
    def __init__(self, redis: aioredis.Redis | aioredis.RedisCluster, namespace: str,
                 count: int = 256,
                 block_ms: int = BLOCK_MS, wake_key: str = "") -> None:
        self._redis = redis
        self._count = count
        self._block_ms = block_ms
        self._wake_key = wake_key or f"{namespace}:streamhub:{uuid.uuid4().hex}:wake"
        self._wake_cursor: str | bytes = "0-0"
        self._head = b"".join(_arg(a) for a in ("XREAD", "COUNT", str(count), "BLOCK",
                                                 str(block_ms), "STREAMS"))
        self._waiters: dict[str, list[_Waiter]] = {}
        self._asked: dict[str, tuple[int, int]] = {}  # the XREAD's cursor of each stream
        self._task: asyncio.Task[None] | None = None
        self._blocked = False  # an XREAD is on its way or blocking
        self._woken = False  # this XREAD was already woken

    def waiting(self) -> int:
        return sum(len(ws) for ws in self._waiters.values())

    async def read(self, key: str, cursor: str | bytes, wait_s: float) -> list[Entry]:
        """The entries of stream `key` after `cursor` (at most `count`), waiting up to
        `wait_s` for one; [] if none came. Raises the XREAD's RedisError."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(_entry_id(cursor), loop.create_future(), _arg(key), _arg(cursor))
        self._waiters.setdefault(key, []).append(waiter)
        # A timer that answers [] rather than wait_for(shield()): the waiter wakes one loop
        # turn after its entries are handed out (not three), so it is back, and in the
        # next XREAD, before the hub sends it; and no timeout machinery per read.
        timer = loop.call_later(wait_s, _time_out, waiter.future)
        try:
            self._start()
            if self._blocked and not self._woken:
                self._woken = True
                await self._wake()
            return await waiter.future
        finally:
            timer.cancel()
            self._drop(key, waiter)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, aioredis.RedisError):
                await self._task

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _wake(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(self._wake_key, {"w": b"1"}, maxlen=1, approximate=False)
        pipe.expire(self._wake_key, WAKE_TTL_S)
        await pipe.execute()

    async def _acquire(self) -> AbstractConnection:
        pool = cast(aioredis.Redis, self._redis).connection_pool  # a cluster's: _NodeHub
        return await pool.get_connection()

    async def _release(self, conn: AbstractConnection) -> None:
        await cast(aioredis.Redis, self._redis).connection_pool.release(conn)

    async def _run(self) -> None:
        # One pooled connection for as long as streams wait: the XREAD holds one nearly
        # all the time anyway, and taking it from the pool each cycle was work for nothing.
        try:
            await self._serve_on_a_connection()
        except aioredis.RedisError as exc:
            self._fail_all(exc)
        finally:
            self._task = None

    async def _serve_on_a_connection(self) -> None:
        conn = await self._acquire()
        try:
            await self._serve(conn)
        finally:
            await self._release(conn)

    async def _serve(self, conn: AbstractConnection) -> None:
        """XREADs on `conn` while streams wait."""
        while self._waiters:
            reply = await self._xread(conn)
            for raw_key, entries in _streams(reply):
                key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                if key == self._wake_key:
                    self._wake_cursor = entries[-1][0]
                else:
                    self._hand_out(key, entries)
            # The waiters served write their frames and come back now, so that the
            # next XREAD has them without a wake.
            await asyncio.sleep(0)

    async def _xread(self, conn: AbstractConnection) -> XReadReply:
        command = self._command()
        self._blocked, self._woken = True, False
        try:
            # As redis-py's execute_command: retried on a connection error (its Retry).
            return await conn.retry.call_with_retry(
                lambda: self._send(conn, command), lambda _: conn.disconnect())
        finally:
            self._blocked = False

    @staticmethod
    async def _send(conn: AbstractConnection, command: bytes) -> XReadReply:
        await conn.send_packed_command(command)
        reply: XReadReply = await conn.read_response()
        return reply

    def _command(self) -> bytes:
        """XREAD COUNT BLOCK STREAMS <keys> <cursors>, each stream from its furthest-behind
        waiter, joined from the waiters' packed arguments: redis-py packed every argument
        anew per XREAD, a third of a cycle's cost at 64 streams."""
        firsts = [ws[0] if len(ws) == 1 else min(ws, key=_cursor_of)
                  for ws in self._waiters.values()]
        self._asked = {key: w.cursor for key, w in zip(self._waiters, firsts, strict=True)}
        return b"".join((b"*%d\r\n" % (2 * len(firsts) + 8), self._head,
                         *[w.key_arg for w in firsts], _arg(self._wake_key),
                         *[w.cursor_arg for w in firsts], _arg(self._wake_cursor)))

    def _hand_out(self, key: str, raw_entries: list[RawEntry]) -> None:
        """The reply's entries of `key` to each of its waiters, those after its cursor. A
        waiter further back than the XREAD asked (it came while the XREAD was out) would
        miss the entries between: it waits for the next XREAD, which asks from it."""
        asked = self._asked.get(key, (0, 0))
        entries = [_entry(raw) for raw in raw_entries]
        first = _entry_id(entries[0][0])
        for waiter in self._waiters.pop(key, []):
            if waiter.cursor < asked:
                after = []
            elif first > waiter.cursor:  # all of them: most waiters, and no id parsed
                after = entries
            else:  # another waiter on the stream was behind this one
                after = [entry for entry in entries if _entry_id(entry[0]) > waiter.cursor]
            if not after:
                self._waiters.setdefault(key, []).append(waiter)
            elif not waiter.future.done():
                waiter.future.set_result(after)

    def _fail_all(self, exc: BaseException) -> None:
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.future.done():
                    waiter.future.set_exception(exc)
        self._waiters.clear()

    def _drop(self, key: str, waiter: _Waiter) -> None:
        waiters = self._waiters.get(key)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[key]
        if waiter.future.done() and not waiter.future.cancelled():
            waiter.future.exception()  # retrieved: no "never retrieved" warning



class TaggedStreamHub:
    """StreamHub on a Redis Cluster (TIDEGATE_STREAMS_URL): one XREAD per job tag, each on
    the node serving that tag's slot. A cluster refuses a command whose keys span slots,
    and a job's keys carry one of 24 tags (tidegate/keys.py), so the streams of a tag share
    a slot: at 256 streams an XREAD still serves about ten of them."""

    def __init__(self, cluster: aioredis.RedisCluster, namespace: str, count: int = 256,
                 block_ms: int = BLOCK_MS) -> None:
        self._cluster, self._ns = cluster, namespace
        self._count, self._block_ms = count, block_ms
        self._id = uuid.uuid4().hex
        self._hubs: dict[str, _NodeHub] = {}

    def waiting(self) -> int:
        return sum(hub.waiting() for hub in self._hubs.values())

    async def read(self, key: str, cursor: str | bytes, wait_s: float) -> list[Entry]:
        """StreamHub.read, by the hub of the stream's tag."""
        tag = keys.tag_of(key)
        hub = self._hubs.get(tag)
        if hub is None:
            hub = self._hubs[tag] = _NodeHub(
                self._cluster, self._ns, self._count, self._block_ms,
                keys.streamhub_wake(self._ns, tag, self._id))
        return await hub.read(key, cursor, wait_s)

    async def close(self) -> None:
        for hub in self._hubs.values():
            await hub.close()


class _NodeHub(StreamHub):
    """The XREADs of one tag, on a connection of the node serving its slot now. When the
    node fails (it died, or the slot moved) the hub reads the cluster's layout again and
    goes on, on the replica a failover promoted, for up to FAILOVER_S: its waiters' own
    timers answer [] meanwhile, and they come back, as a Sentinel client's retries do."""

    _stale = False
    _node: ClusterNode | None = None

    _answered_at = 0.0  # the last XREAD's answer (a block's end included)

    async def _run(self) -> None:
        started = time.monotonic()
        try:
            while self._waiters:
                try:
                    await self._serve_on_a_connection()
                except NODE_FAILURES:
                    if time.monotonic() - max(started, self._answered_at) > FAILOVER_S:
                        raise
                    self._stale = True
                    await asyncio.sleep(FAILOVER_POLL_S)
        except aioredis.RedisError as exc:
            self._fail_all(exc)
        finally:
            self._task = None

    async def _xread(self, conn: AbstractConnection) -> XReadReply:
        reply = await super()._xread(conn)
        self._answered_at = time.monotonic()
        return reply

    async def _wake(self) -> None:
        # A wake that fails leaves the waiter to the next XREAD: the hub is then retrying.
        with contextlib.suppress(aioredis.RedisError):
            await super()._wake()

    async def _acquire(self) -> AbstractConnection:
        cluster = cast(aioredis.RedisCluster, self._redis)
        await cluster.initialize()
        if self._stale:
            await cluster.nodes_manager.initialize()  # the layout after a failover
            self._stale = False
        self._node = cluster.get_node_from_key(self._wake_key)
        if self._node is None:
            raise aioredis.ConnectionError(f"no node serves the slot of {self._wake_key}")
        conn = self._node.acquire_connection()
        await self._node.disconnect_if_needed(conn)
        return conn

    async def _release(self, conn: AbstractConnection) -> None:
        if not conn.is_connected:  # a failed node's: not kept for the next
            await conn.disconnect()
        assert self._node is not None  # the node `_acquire` took it from
        self._node.release(cast(Connection, conn))  # a node's: what acquire_connection gave


def stream_hub(redis: aioredis.Redis | aioredis.RedisCluster,
               namespace: str) -> StreamHub | TaggedStreamHub:
    """The hub for the streams' Redis: one XREAD for all, or one per tag on a cluster."""
    if redisconn.is_cluster_client(redis):
        return TaggedStreamHub(cast(aioredis.RedisCluster, redis), namespace)
    return StreamHub(redis, namespace)
