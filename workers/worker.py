"""The worker process as one object: its engine, its lifecycle phase, the jobs in flight
and their outcomes, and the two threads beside Celery's (heartbeat, cancel listener).

State is derived, not stored, where Celery already knows the truth: a ready worker is
`active` while it consumes its pool queue (the scheduler's `add_consumer`), `draining`
once it stopped consuming it but still runs jobs, `standby` when idle on its direct queue
alone. Only the phase (`starting`, `ready`, `restarting`) and a Celery shutdown are set
here. Celery reaches this object through `current()`, from workers/celery_hooks.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from enum import StrEnum
from typing import Any

import redis

from store import Store
from tasks.recovery import restore_orphans
from tidegate import keys
from tidegate.lanes import pool_queue
from tidegate.records import EngineStats, Heartbeat, WorkerState
from tidegate.settings import Settings
from workers.engine import Engine
from workers.host import EngineHost
from workers.publisher import EventPublisher
from workers.runner import WorkerContext, run_job

log = logging.getLogger("tidegate.worker")


class Phase(StrEnum):
    STARTING = "starting"  # the engine loads
    READY = "ready"  # serving: the state follows the queues Celery consumes
    DRAINING = "draining"  # Celery is shutting down: no new job, in-flight ones finish
    RESTARTING = "restarting"  # exiting for a fresh process (RESTART_EXIT)


class Worker:
    def __init__(self, settings: Settings, name: str, lane: str, pool: str,
                 celery_worker: Any) -> None:
        self.settings, self.name, self.lane, self.pool = settings, name, lane, pool
        self.celery_worker = celery_worker  # for the queues it consumes now
        self.pool_queue = pool_queue(settings.lanes[lane], pool)
        self.direct_queue = keys.direct_queue(settings.namespace, name)
        self.boot = uuid.uuid4().hex  # tells a restarted process (same name) from the old
        self.phase = Phase.STARTING
        # Fault injection for health tests and drills: the allocation latency this worker
        # reports instead of the engine's own (None: report the engine's).
        self.forced_alloc_latency_ms: float | None = None
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.ctx: WorkerContext | None = None  # set once the engine is loaded and warmed
        self._lock = threading.Lock()
        self._in_flight = 0
        self._outcomes: dict[str, int] = {}

    # -- engine ----------------------------------------------------------------------

    def load(self, engine: Engine) -> None:
        """Starts the heartbeat, then loads and warms the engine (minutes on a GPU)."""
        Heartbeats(self).start()
        host = EngineHost(engine)
        started = time.monotonic()
        host.start(warm_prompts=["warm up"])
        log.info("engine loaded and warmed in %.1f s", time.monotonic() - started)
        s = self.settings
        publisher = EventPublisher(self.redis, s.namespace, s.stream_maxlen, s.stream_ttl_s)
        self.ctx = WorkerContext(name=self.name, namespace=s.namespace, store=Store(s.db_url),
                                 redis=self.redis, publisher=publisher, host=host,
                                 lease_ttl_s=keys.lease_ttl_s(s.heartbeat_s),
                                 max_attempts=s.max_attempts, lanes=[self.lane])
        CancelListener(self.redis, s.namespace, host).start()

    @property
    def host(self) -> EngineHost:
        if self.ctx is None:
            raise RuntimeError(f"worker {self.name}: its engine is not loaded yet")
        return self.ctx.host

    def stop(self) -> None:
        if self.ctx is not None:
            self.ctx.host.stop()

    # -- jobs ------------------------------------------------------------------------

    def run(self, body: dict[str, Any]) -> str:
        """One generate task; returns its outcome."""
        ctx = self.ctx
        if ctx is None:
            raise RuntimeError("the engine bootstep has not run: start workers with "
                               "`tidegate worker`")
        with self._lock:
            self._in_flight += 1
        try:
            outcome = run_job(ctx, body)
        finally:
            with self._lock:
                self._in_flight -= 1
        with self._lock:
            self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
        return outcome

    def counts(self) -> tuple[int, dict[str, int]]:
        """Jobs in flight now, and deliveries so far by outcome."""
        with self._lock:
            return self._in_flight, dict(self._outcomes)

    # -- state -----------------------------------------------------------------------

    def consumed(self) -> set[str]:
        consumer = getattr(self.celery_worker, "consumer", None)
        task_consumer = getattr(consumer, "task_consumer", None)
        return {q.name for q in getattr(task_consumer, "queues", [])}

    def state(self) -> WorkerState:
        if self.phase in (Phase.STARTING, Phase.RESTARTING):
            return WorkerState(self.phase.value)
        if self.phase is Phase.READY and self.pool_queue in self.consumed():
            return WorkerState.ACTIVE
        in_flight, _ = self.counts()
        if self.phase is Phase.DRAINING or in_flight:
            return WorkerState.DRAINING
        return WorkerState.STANDBY

    def engine_stats(self) -> EngineStats | None:
        """The engine's figures, with the injected allocation latency if there is one."""
        if self.ctx is None:
            return None
        stats = self.ctx.host.engine.stats()
        if self.forced_alloc_latency_ms is not None:
            stats = dataclasses.replace(
                stats, avg_cache_allocation_latency_ms=self.forced_alloc_latency_ms)
        return stats

    def heartbeat(self) -> Heartbeat:
        profile = self.settings.lanes[self.lane]
        stats = self.engine_stats()
        return Heartbeat(
            name=self.name, state=self.state(), lanes=(self.lane,), pool=self.pool,
            slots=self.settings.engine_slots, queues=(self.pool_queue, self.direct_queue),
            consuming=tuple(sorted(self.consumed())), model=str(self.settings.model_path),
            dtype=profile.dtype,
            # What the engine really runs (an FP8 KV cache may fall back on a CPU).
            kv_cache_dtype=(stats.kv_cache_dtype if stats else "") or profile.kv_cache_dtype,
            lora=tuple(name for name, _ in self.settings.lora), pid=os.getpid(),
            boot=self.boot, host=socket.gethostname(), ts=time.time(),
            engine=self.ctx.host.engine.kind if self.ctx else "", stats=stats,
            mean_job_ms=self.ctx.mean_job_ms if self.ctx else None)


class Heartbeats(threading.Thread):
    """Advertises the worker and its engine stats, renews the leases of its jobs, and
    (one worker per period) hands dead workers' messages back to their queues."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.worker = worker

    def run(self) -> None:
        while True:
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            time.sleep(self.worker.settings.heartbeat_s)

    def beat(self) -> None:
        w, s = self.worker, self.worker.settings
        ttl = keys.heartbeat_ttl_s(s.heartbeat_s)
        w.redis.set(keys.worker_heartbeat(s.namespace, w.name), w.heartbeat().to_json(), ex=ttl)
        if w.ctx is None:
            return
        for lease in w.ctx.held_leases():
            lease.renew()
        period = int(time.time() / s.heartbeat_s)
        if w.redis.set(keys.scheduler_lock(s.namespace, "recover", period), w.name, nx=True,
                       ex=ttl):
            try:
                self.recover()
            except Exception:  # a failed sweep must not stop the heartbeat; the next retries
                log.exception("the sweep for a dead worker's messages failed")

    def recover(self) -> None:
        """A message whose job has no lease for longer than a lease lives has lost its
        worker (workers/lease.py, tasks/recovery.py)."""
        w = self.worker
        grace_s = keys.lease_ttl_s(w.settings.heartbeat_s)
        restore_orphans(w.celery_worker.app, self.leased, grace_s)

    def leased(self, job_ids: list[str]) -> set[str]:
        """The jobs that an attempt holds now (their lease exists), in one round trip."""
        ns, pipe = self.worker.settings.namespace, self.worker.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(keys.job_lease(ns, job_id))
        return {job_id for job_id, n in zip(job_ids, pipe.execute(), strict=True) if n}


class CancelListener(threading.Thread):
    """Aborts engine requests whose job was cancelled (ids broadcast on one channel)."""

    def __init__(self, client: redis.Redis, namespace: str, host: EngineHost) -> None:
        super().__init__(name="cancel-listener", daemon=True)
        self.r, self.ns, self.host = client, namespace, host

    def run(self) -> None:
        while True:  # resubscribe after a dropped connection
            try:
                pubsub = self.r.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(keys.cancel_channel(self.ns))
                while True:
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None:
                        job_id = message["data"].decode()
                        log.info("cancel of job %s received", job_id)
                        self.host.cancel(job_id)
            except redis.RedisError as exc:
                log.warning("cancel listener lost Redis (%s); resubscribing", exc)
                time.sleep(1)


_current: Worker | None = None


def current() -> Worker:
    """This process's worker (one per process), once the engine bootstep has built it."""
    if _current is None:
        raise RuntimeError("the engine bootstep has not run: start workers with "
                           "`tidegate worker`")
    return _current


def set_current(worker: Worker) -> None:
    global _current
    _current = worker
