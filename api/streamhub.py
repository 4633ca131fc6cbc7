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
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Any

from redis import asyncio as aioredis

BLOCK_MS = 1000  # one XREAD's longest block; waiters time out on their own before
WAKE_TTL_S = 60  # the wake stream outlives no API process by long


@dataclass(eq=False)  # waiters are told apart by identity
class _Waiter:
    cursor: tuple[int, int]  # the last entry id it has
    future: asyncio.Future[list[Any]] = field(repr=False)


def _entry_id(raw: str | bytes) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class StreamHub:
    def __init__(self, redis: Any, namespace: str, count: int = 256,
                 block_ms: int = BLOCK_MS) -> None:
        self._redis = redis
        self._count = count
        self._block_ms = block_ms
        self._wake_key = f"{namespace}:streamhub:{uuid.uuid4().hex}:wake"
        self._wake_cursor = "0-0"
        self._waiters: dict[str, list[_Waiter]] = {}
        self._task: asyncio.Task[None] | None = None
        self._blocked = False  # an XREAD is on its way or blocking
        self._woken = False  # this XREAD was already woken

    def waiting(self) -> int:
        return sum(len(ws) for ws in self._waiters.values())

    async def read(self, key: str, cursor: str | bytes, wait_s: float) -> list[Any]:
        """The entries of stream `key` after `cursor` (at most `count`), waiting up to
        `wait_s` for one; [] if none came. Raises the XREAD's RedisError."""
        waiter = _Waiter(_entry_id(cursor), asyncio.get_running_loop().create_future())
        self._waiters.setdefault(key, []).append(waiter)
        try:
            self._start()
            if self._blocked and not self._woken:
                self._woken = True
                await self._wake()
            return await asyncio.wait_for(asyncio.shield(waiter.future), wait_s)
        except TimeoutError:
            return []
        finally:
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

    async def _run(self) -> None:
        try:
            while self._waiters:
                reply = await self._xread()
                for raw_key, entries in reply or []:
                    key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                    if key == self._wake_key:
                        self._wake_cursor = entries[-1][0]
                    else:
                        self._hand_out(key, entries)
                # The waiters served write their frames and come back now, so that the
                # next XREAD has them without a wake.
                await asyncio.sleep(0)
        except aioredis.RedisError as exc:
            self._fail_all(exc)
        finally:
            self._task = None

    async def _xread(self) -> Any:
        streams: dict[str, Any] = {key: "{}-{}".format(*min(w.cursor for w in ws))
                                   for key, ws in self._waiters.items()}
        streams[self._wake_key] = self._wake_cursor
        self._blocked, self._woken = True, False
        try:
            return await self._redis.xread(streams, block=self._block_ms, count=self._count)
        finally:
            self._blocked = False

    def _hand_out(self, key: str, entries: list[Any]) -> None:
        ids = [_entry_id(entry_id) for entry_id, _ in entries]
        for waiter in self._waiters.pop(key, []):
            after = [entry for entry, at in zip(entries, ids, strict=True) if at > waiter.cursor]
            if not after:  # it has these already (another waiter on the stream was behind)
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

