"""The API's submits and stream openings, most urgent lane first.

A submit's blocking part (key lookup, tokenizing, routing, the job row, the broker publish)
costs milliseconds of CPU, a stream opening's (key lookup, the job row) a little less.
Under a burst those milliseconds queue, and on a plain thread pool a finance job waits
behind every chat job that arrived before it. Here the pending calls wait in a priority
queue, so a more urgent lane's starts next, and only a few threads run at once, so the
queue, not the GIL, decides the order.

Both waits are bounded. The queue holds at most `max_waiting` calls; one more is refused
at once with a 503 (`overloaded`, Retry-After), not parked behind a backlog it would
outwait. SSE streams, which hold a Redis connection each for as long as they are open, are
counted here too (StreamSlots): in all and per tenant, each over its cap a 429.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from api.errors import over_limit, unavailable

T = TypeVar("T")
STOP = (float("inf"),)  # sorts after every real rank


class Admission:
    """`threads` threads running blocking calls by rank (lower first), then arrival; at
    most `max_waiting` calls wait."""

    def __init__(self, threads: int, max_waiting: int = 1000) -> None:
        self.max_waiting = max_waiting
        self._pending: queue.PriorityQueue[tuple[Any, ...]] = queue.PriorityQueue()
        self._arrival = itertools.count()
        self._threads = [threading.Thread(target=self._serve, name=f"api-admission-{i}",
                                          daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    async def run(self, rank: tuple[float, ...], fn: Callable[..., T], *args: Any) -> T:
        if self._pending.qsize() >= self.max_waiting:
            raise unavailable(f"the API is overloaded: {self.max_waiting} requests wait to be "
                              "admitted; retry in 1 s", retry_after_s=1, kind="overloaded")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        # Run in the caller's context (as asyncio.to_thread does): the request's trace span
        # stays current in the admission thread, where the job row gets its trace id.
        call = contextvars.copy_context().run
        self._pending.put((rank, next(self._arrival), call, (fn, *args), loop, done))
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


class StreamSlots:
    """The SSE streams open in this process, at most `total` in all and `per_tenant` per
    tenant. Taken and released on the event loop only, so no lock."""

    RETRY_AFTER_S = 5

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total, self.per_tenant = total, per_tenant
        self._open: dict[int, int] = {}  # tenant id -> streams open
        self._total = 0

    def open(self) -> int:
        return self._total

    def take(self, tenant_id: int) -> Callable[[], None]:
        """A slot for one of the tenant's streams, as the function that gives it back
        (once, however often it is called); 429 `too_many_streams` when none is free."""
        if self.open() >= self.total:
            raise self._full(f"this API process has {self.total} streams open, its limit")
        mine = self._open.get(tenant_id, 0)
        if mine >= self.per_tenant:
            raise self._full(f"this API key has {mine} streams open here, at most "
                             f"{self.per_tenant}")
        self._open[tenant_id] = mine + 1
        self._total += 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self._total -= 1
                left = self._open[tenant_id] - 1
                if left:
                    self._open[tenant_id] = left
                else:
                    del self._open[tenant_id]

        return give_back

    def _full(self, why: str) -> Exception:
        return over_limit("too_many_streams", f"too many event streams: {why}; close one or "
                          f"retry in {self.RETRY_AFTER_S} s", self.RETRY_AFTER_S)


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
