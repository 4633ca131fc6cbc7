"""The API's one XREAD over every waiting stream (api/streamhub.py), on the session's
Redis: what a waiter gets, when its wait runs out, when it comes while the XREAD blocks,
when it leaves, and when Redis fails or fails over (a Sentinel trio of its own). Each
test runs its own hub on its own Redis database, on keys of its own. A test that needs the hub's
XREAD blocking waits for it in Redis's CLIENT LIST, never for a guessed time."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis import asyncio as aioredis
from redis.crc import key_slot

from api.streamhub import StreamHub, TaggedStreamHub, stream_hub
from tests.helpers import own_db, tool_or_skip
from tests.stack.test_sentinel import redis_trio
from tidegate import keys, redisconn
from tidegate_tools.procs import RedisClusterProcs, free_port, redis_cluster

DB = own_db(__name__, "41")


@pytest.fixture
def url(redis_server: str) -> Iterator[str]:
    own = redis_server.rsplit("/", 1)[0] + f"/{DB}"
    yield own
    redis.Redis.from_url(own).flushdb()


def run(url: str, test: Callable[[StreamHub, Any, str], Awaitable[None]],
        block_ms: int = 5000, **client: Any) -> None:
    """`test(hub, client, key)` on a hub of its own, with a fresh stream key."""
    async def main() -> None:
        r = aioredis.Redis.from_url(url, **client)
        hub = StreamHub(r, f"tghub{uuid.uuid4().hex[:8]}", block_ms=block_ms)
        try:
            await asyncio.wait_for(test(hub, r, f"hubtest:{uuid.uuid4().hex}"), 20)
        finally:
            await hub.close()
            await r.aclose()

    asyncio.run(main())


def ids(entries: list[Any]) -> list[bytes]:
    return [entry_id for entry_id, _ in entries]


async def xread_blocks(r: Any, timeout_s: float = 10.0) -> None:
    """Until a connection of this module's DB blocks in XREAD (the hub's: a test holds
    one hub at a time), as Redis's CLIENT LIST shows it (flag `b`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(c["cmd"] == "xread" and "b" in c["flags"] and c["db"] == str(DB)
               for c in await r.client_list()):
            return
        await asyncio.sleep(0.01)  # a poll's pace, not a guess at when it blocks
    raise TimeoutError(f"no XREAD blocked on DB {DB} after {timeout_s} s")


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_waiter_gets_the_entries_after_its_cursor_with_their_fields(url: str,
                                                                      protocol: int) -> None:
    async def test(hub: StreamHub, r: Any, key: str) -> None:
        await r.xadd(key, {"e": "zero", "k": "started"}, id="1-0")
        await r.xadd(key, {"e": "one", "k": "token"}, id="2-0")
        assert await hub.read(key, "0-0", 1) == [(b"1-0", {b"e": b"zero", b"k": b"started"}),
                                                 (b"2-0", {b"e": b"one", b"k": b"token"})]
        reading = asyncio.create_task(hub.read(key, b"2-0", 5))
        await xread_blocks(r)
        await r.xadd(key, {"e": "two", "k": "done"}, id="3-0")
        assert await reading == [(b"3-0", {b"e": b"two", b"k": b"done"})]

    run(url, test, protocol=protocol)


def test_a_wait_that_runs_out_answers_nothing_and_the_entries_stay(url: str) -> None:
    """The XREAD blocks 25 s: a wait of 0.2 s answers [] on its own timer, well inside
    the 15 s this test gives it (a hub that answered only when its XREAD ran out would
    not)."""
    async def test(hub: StreamHub, r: Any, key: str) -> None:
        started = time.monotonic()
        assert await asyncio.wait_for(hub.read(key, "0-0", 0.2), 15) == []
        assert time.monotonic() - started >= 0.2  # not early: load only makes it later
        assert hub.waiting() == 0
        await r.xadd(key, {"e": "late"}, id="1-0")
        assert ids(await hub.read(key, "0-0", 1)) == [b"1-0"]

    run(url, test, block_ms=25_000)


def test_a_waiter_that_comes_while_the_xread_blocks_is_served_at_once(url: str) -> None:
    """The XREAD blocks 25 s on another stream; the newcomer, who waits 10 s, gets its
    entry: without the hub's wake it would still be outside that XREAD, and get []."""
    async def test(hub: StreamHub, r: Any, key: str) -> None:
        other = asyncio.create_task(hub.read(key + ":other", "0-0", 20))
        await xread_blocks(r)
        reading = asyncio.create_task(hub.read(key, "0-0", 10))
        await r.xadd(key, {"e": "x"}, id="1-0")
        assert ids(await reading) == [b"1-0"]
        other.cancel()

    run(url, test, block_ms=25_000)


def test_a_waiter_behind_the_xread_in_flight_gets_no_gap(url: str) -> None:
    """A second reader of a stream joins, from further back, just as the XREAD's answer
    (after the first reader's cursor) arrives: it gets every entry after its own cursor,
    from the next XREAD, not the answer that skips the ones between."""
    async def test(hub: StreamHub, r: Any, key: str) -> None:
        for seq in (1, 2):
            await r.xadd(key, {"e": str(seq)}, id=f"{seq}-0")
        ahead = asyncio.create_task(hub.read(key, "2-0", 10))
        await xread_blocks(r)  # from 2-0
        # Written without a turn of the loop: the XREAD's answer waits, unread, until the
        # reader behind has joined.
        redis.Redis(connection_pool=redis.ConnectionPool.from_url(url)).xadd(
            key, {"e": "3"}, id="3-0")
        behind = asyncio.create_task(hub.read(key, "0-0", 10))
        assert ids(await ahead) == [b"3-0"]
        assert ids(await behind) == [b"1-0", b"2-0", b"3-0"]

    run(url, test)


def test_a_reader_that_leaves_leaves_no_waiter(url: str) -> None:
    async def test(hub: StreamHub, r: Any, key: str) -> None:
        reading = asyncio.create_task(hub.read(key, "0-0", 10))
        await xread_blocks(r)
        assert hub.waiting() == 1
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert hub.waiting() == 0
        await r.xadd(key, {"e": "x"}, id="1-0")  # nobody to hand it to
        assert ids(await hub.read(key, "0-0", 1)) == [b"1-0"]

    run(url, test)


def test_redis_failing_fails_the_waiters(url: str) -> None:
    """No Redis where the hub's client points: every read raises the RedisError (the SSE
    stream's `unavailable` frame), and none is left waiting."""
    async def main() -> None:
        r = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0",
                                    socket_connect_timeout=0.5)
        hub = StreamHub(r, "tghubdown")
        reads = [hub.read(f"hubtest:down:{i}", "0-0", 10) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*reads, return_exceptions=True), 20)
        assert all(isinstance(result, aioredis.RedisError) for result in results), results
        assert hub.waiting() == 0
        await hub.close()
        await r.aclose()

    asyncio.run(main())


def test_a_hub_blocked_on_the_master_follows_the_failover(tmp_root: Path) -> None:
    """The hub's XREAD, on the connection it holds from a Sentinel-managed pool, blocks on
    the master when it dies: retried as redis-py retries a command, on the replica the
    sentinel promotes, it hands out what is written there."""
    key = "ha:hub"
    with redis_trio(tmp_root / "logs" / "sentinel-hub") as trio:
        async def main() -> list[Any]:
            client = redisconn.async_client(trio.url, socket_timeout=30)
            hub = StreamHub(client, "tghubha", block_ms=25_000)
            reading = asyncio.create_task(hub.read(key, "0-0", 60))
            master = trio.node(trio.master_port)
            while not any(c["cmd"] == "xread" for c in master.client_list()):
                await asyncio.sleep(0.05)
            await asyncio.to_thread(trio.fail_over, trio.procs)
            trio.node(trio.replica_port).xadd(key, {"e": "1"}, id="1-0")
            try:
                return await asyncio.wait_for(reading, 30)
            finally:
                await hub.close()
                await client.aclose()

        assert asyncio.run(main()) == [(b"1-0", {b"e": b"1"})]


# -- on a Redis Cluster (TIDEGATE_STREAMS_URL): one XREAD per job tag -------------------

@pytest.fixture(scope="module")
def cluster(tmp_root: Path) -> Iterator[RedisClusterProcs]:
    """Three masters, a replica each (the failover case promotes one)."""
    tool_or_skip("redis-cli", "Debian's redis-tools: make ops-tools")
    with redis_cluster(tmp_root / "logs" / "hub-cluster", replicas=1) as procs:
        yield procs


def job_streams(ns: str, count: int) -> list[str]:
    return [keys.job_events(ns, f"job-{i}") for i in range(count)]


def test_a_tagged_hub_reads_the_streams_of_every_shard(cluster: RedisClusterProcs) -> None:
    """Streams of 24 jobs, their tags on all three masters: each waiter gets its own
    stream's entries, through the XREAD of its tag on the node serving it."""
    ns = f"tghub{uuid.uuid4().hex[:8]}"
    streams = job_streams(ns, 24)
    assert {cluster.master_of_slot(key_slot(k.encode())) for k in streams} == \
        set(cluster.masters_now())

    async def main() -> list[Any]:
        client = redisconn.async_streams_client(cluster.url)
        hub = stream_hub(client, ns)
        assert isinstance(hub, TaggedStreamHub)
        try:
            reads = [asyncio.create_task(hub.read(k, "0-0", 20)) for k in streams]
            for i, k in enumerate(streams):
                await client.xadd(k, {"e": str(i)}, id="1-0")
            return await asyncio.wait_for(asyncio.gather(*reads), 30)
        finally:
            await hub.close()
            await client.aclose()

    got = asyncio.run(main())
    assert got == [[(b"1-0", {b"e": str(i).encode()})] for i in range(len(streams))]


def test_a_tagged_hub_follows_its_node_s_failover(cluster: RedisClusterProcs) -> None:
    """The XREAD of a tag blocks on its master when that master is SIGKILLed: the hub reads
    the cluster's layout again and hands out what is written on the promoted replica."""
    ns = f"tghubfail{uuid.uuid4().hex[:8]}"
    key = job_streams(ns, 1)[0]
    master = cluster.master_of_slot(key_slot(key.encode()))

    async def main() -> list[Any]:
        client = redisconn.async_streams_client(cluster.url)
        hub = stream_hub(client, ns)
        try:
            reading = asyncio.create_task(hub.read(key, "0-0", 60))
            node = cluster.node(master)
            while not any(c["cmd"] == "xread" for c in node.client_list()):
                await asyncio.sleep(0.05)
            await asyncio.to_thread(cluster.kill_master, master)
            writer = redisconn.sync_streams_client(cluster.url)
            writer.xadd(key, {"e": "1"}, id="1-0")
            writer.close()
            return await asyncio.wait_for(reading, 40)
        finally:
            await hub.close()
            await client.aclose()

    assert asyncio.run(main()) == [(b"1-0", {b"e": b"1"})]
