"""The API's submits and stream openings, most urgent lane first.

A submit's blocking part (key lookup, tokenizing, routing, the job row, the broker publish)
costs milliseconds of CPU, a stream opening's (key lookup, the job row) a little less.
Under a burst those milliseconds queue, and on a plain thread pool a finance job waits
behind every chat job that arrived before it. Here the pending calls wait in a priority
queue, so a more urgent lane's starts next, and only a few threads run at once, so the
queue, not the GIL, decides the order.

Both waits are bounded. The queue holds at most `max_waiting` calls; one more is refused
at once with a 503 (`overloaded`, Retry-After), not parked behind a backlog it would
outwait. The key lookups of unknown callers (api/auth.py: a key never seen valid) rank
after every other call and have a bound of their own (`max_unknown`): a flood of them
is refused on its own and never takes a tenant's place in the queue. SSE streams, which
hold a Redis connection each for as long as they are open, are counted here too
(StreamSlots): in all and per tenant, each over its cap a 429.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar, TypeVarTuple

from api.errors import over_limit, unavailable

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
STOP = (float("inf"),)  # sorts after every real rank


class Admission:
    """`threads` threads running blocking calls by rank (lower first), then arrival; at
    most `max_waiting` calls wait, and beside them at most `max_unknown` of unknown
    callers."""

    def __init__(self, threads: int, max_waiting: int = 1000, max_unknown: int = 64) -> None:
        self.max_waiting, self.max_unknown = max_waiting, max_unknown
        self._pending: queue.PriorityQueue[tuple[Any, ...]] = queue.PriorityQueue()
        self._arrival = itertools.count()
        self._unknown = 0  # unknown callers' calls waiting (under _lock)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._serve, name=f"api-admission-{i}",
                                          daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    async def run(self, rank: tuple[float, ...], fn: Callable[[*Ts], T], *args: *Ts,
                  unknown_caller: bool = False) -> T:
        """fn(*args) on an admission thread, in its turn. `unknown_caller`: a call made for
        a caller not known yet (rank it last), counted against `max_unknown` only."""
        self._admit(unknown_caller)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        # Run in the caller's context (as asyncio.to_thread does): the request's trace span
        # stays current in the admission thread, where the job row gets its trace id.
        call = contextvars.copy_context().run
        self._pending.put((rank, next(self._arrival), call, (fn, *args), loop, done,
                           unknown_caller))
        return await done

    def _admit(self, unknown_caller: bool) -> None:
        """Takes a place in the queue, or raises 503 `overloaded` when none is left."""
        with self._lock:
            if unknown_caller:
                if self._unknown < self.max_unknown:
                    self._unknown += 1
                    return
                waiting, cap, who = self._unknown, self.max_unknown, "unknown callers' "
            else:
                waiting, cap, who = self._pending.qsize() - self._unknown, self.max_waiting, ""
                if waiting < cap:
                    return
        raise unavailable(f"the API is overloaded: {waiting} {who}requests wait to be "
                          f"admitted, at most {cap}; retry in 1 s", retry_after_s=1,
                          kind="overloaded")

    def close(self) -> None:
        for _ in self._threads:
            self._pending.put((STOP, next(self._arrival), None, (), None, None, False))
        for thread in self._threads:
            thread.join(timeout=5)

    def waiting(self) -> int:
        return self._pending.qsize()

    def _serve(self) -> None:
        while True:
            _, _, fn, args, loop, done, unknown_caller = self._pending.get()
            if unknown_caller:
                with self._lock:
                    self._unknown -= 1
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
    """The lanes and tenants of the last `size` jobs accepted here: a stream opened right
    after its submit (the usual producer) is ranked by its lane without a store lookup,
    and only its own tenant's resume of it goes first (api/deps.py stream_rank)."""

    def __init__(self, size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._size, self._clock = size, clock
        # job -> (lane, tenant, when it was accepted here)
        self._jobs: OrderedDict[str, tuple[str, int | None, float]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, job_id: str, lane: str, tenant_id: int | None = None) -> None:
        with self._lock:
            self._jobs[job_id] = (lane, tenant_id, self._clock())
            if len(self._jobs) > self._size:
                self._jobs.popitem(last=False)

    def fresh(self, job_id: str, tenant_id: int, within_s: float) -> bool:
        """Whether this process accepted the tenant's job at most `within_s` ago."""
        with self._lock:
            known = self._jobs.get(job_id)
        return (known is not None and known[1] == tenant_id
                and self._clock() - known[2] <= within_s)

    def get(self, job_id: str) -> str | None:
        """The job's lane, if this process accepted it lately."""
        with self._lock:
            known = self._jobs.get(job_id)
        return known[0] if known is not None else None

    def owner(self, job_id: str) -> int | None:
        """The tenant whose job it is, if this process accepted it lately."""
        with self._lock:
            known = self._jobs.get(job_id)
        return known[1] if known is not None else None


def _settle(done: asyncio.Future[T], result: T, exc: BaseException | None) -> None:
    if done.cancelled():
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(result)
