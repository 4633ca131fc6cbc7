"""What every task thread of a worker shares: the store, the Redis clients, the engine host
and the job-running helpers, built once by the engine bootstep (workers/worker.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import redis

from store import Store
from tidegate.redisconn import StreamsClient
from workers.faults import TokenHold
from workers.host import EngineHost
from workers.lease import Lease
from workers.metrics import JobMetrics
from workers.publisher import EventPublisher
from workers.retry import Retrier
from workers.streamer import Streamer


@dataclass
class WorkerContext:
    """Everything a task thread needs; built once by the engine bootstep."""

    name: str
    namespace: str
    store: Store
    redis: redis.Redis  # the main Redis: rate limits
    # The token streams' Redis (TIDEGATE_STREAMS_URL; maybe a cluster, maybe `redis`): a
    # job's lease, stream and cancel key.
    streams: StreamsClient
    publisher: EventPublisher
    host: EngineHost
    lease_ttl_s: int  # keys.lease_ttl_s of the worker's heartbeat period
    max_attempts: int  # takes of one job before it is ended as poison
    retry: Retrier  # every store and Redis call of a job goes through it
    lanes: list[str] = field(default_factory=list)
    hold: TokenHold | None = None  # fault injection (workers/faults.py): unarmed in production
    metrics: JobMetrics | None = None  # Prometheus (workers/metrics.py); None: not counted
    # Publishes every job's token events in one round trip per engine step; None: each
    # task thread publishes its own job's (workers/streamer.py).
    streamer: Streamer | None = None
    mean_job_ms: float | None = None  # moving average of a job's run time, for the router
    leases: set[Lease] = field(default_factory=set)  # held now; the heartbeat renews them
    borrowed: int = 0  # other lanes' jobs running on slots this worker lent
    _leases_lock: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def borrowing(self, borrowed: bool) -> Iterator[None]:
        """Counts the borrowed jobs running here, for the heartbeat (the router's cap)."""
        if not borrowed:
            yield
            return
        with self._leases_lock:
            self.borrowed += 1
        try:
            yield
        finally:
            with self._leases_lock:
                self.borrowed -= 1

    def record_job_ms(self, ms: float) -> None:
        old = self.mean_job_ms
        self.mean_job_ms = ms if old is None else 0.8 * old + 0.2 * ms

    def held_leases(self) -> list[Lease]:
        with self._leases_lock:
            return list(self.leases)

    def _hold(self, lease: Lease, held: bool) -> None:
        with self._leases_lock:
            (self.leases.add if held else self.leases.discard)(lease)
