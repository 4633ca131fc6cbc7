"""The API's submits and stream openings, most urgent lane first.

A submit's blocking part (key lookup, tokenizing, routing, the job row, the broker publish)
costs milliseconds of CPU, a stream opening's (key lookup, the job row) a little less.
Under a burst those milliseconds queue, and on a plain thread pool a finance job waits
behind every chat job that arrived before it. Here the pending calls wait in a priority
queue, so a more urgent lane's starts next, and only a few threads run at once, so the
queue, not the GIL, decides the order.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
STOP = (float("inf"),)  # sorts after every real rank


class Admission:
    """`threads` threads running blocking calls by rank (lower first), then arrival."""

    def __init__(self, threads: int) -> None:
        self._pending: queue.PriorityQueue[tuple[Any, ...]] = queue.PriorityQueue()
        self._arrival = itertools.count()
        self._threads = [threading.Thread(target=self._serve, name=f"api-admission-{i}",
                                          daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    async def run(self, rank: tuple[float, ...], fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._pending.put((rank, next(self._arrival), fn, args, loop, done))
        return await done

    def close(self) -> None:
        for _ in self._threads:
            self._pending.put((STOP, next(self._arrival), None, (), None, None))
        for thread in self._threads:
            thread.join(timeout=5)

    def waiting(self) -> int:
        return self._pending.qsize()

    def _serve(self) -> None:
        while True:
            _, _, fn, args, loop, done = self._pending.get()
            if fn is None:
                return
            if done.cancelled():  # the client went away while it waited
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting handler
                loop.call_soon_threadsafe(_settle, done, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, result, None)


class RecentLanes:
    """The lanes of the last `size` jobs accepted here: a stream opened right after its
    submit (the usual producer) is ranked by its lane without a store lookup."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._lanes: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, job_id: str, lane: str) -> None:
        with self._lock:
            self._lanes[job_id] = lane
            if len(self._lanes) > self._size:
                self._lanes.popitem(last=False)

    def get(self, job_id: str) -> str | None:
        with self._lock:
            return self._lanes.get(job_id)


def _settle(done: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if done.cancelled():
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(result)
