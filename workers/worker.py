"""The worker process as one object: its engine, its lifecycle phase, the jobs in flight
and their outcomes, and the two threads beside Celery's (heartbeat, cancel listener).

State is derived, not stored, where Celery already knows the truth: a ready worker is
`active` while it consumes its pool queue (the scheduler's `add_consumer`), `draining`
once it stopped consuming it but still runs jobs, `standby` when idle on its direct queue
alone. Only the phase (`starting`, `ready`, `restarting`, `failed`) and a Celery shutdown
are set here. Celery reaches this object through `current()`, from the task, the bootstep,
the signals and the control commands (workers/celery_setup.py registers them).

A dead engine (its process killed or crashed) fails the worker: its heartbeat says
`failed` at once, so routers and the scheduler pass it by; it stops consuming; the task of
every job it held returns no outcome at all, leaving the job leaseless and its message
unacked, and once its consumer takes no more messages, the worker hands those back to
their queues itself, as the recovery sweep would (tasks/recovery.py), for another worker
to resume after the tokens already streamed; then the process exits with RESTART_EXIT
and its supervisor starts a fresh one. Should the worker not get that far, the other
workers' sweep hands them back after its grace period.
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
from typing import NoReturn

import redis
from celery.worker import WorkController

from store import Store
from tasks.payloads import GeneratePayload
from tasks.recovery import restore_orphans
from tidegate import gcfreeze, keys, locks, redisconn
from tidegate.backoff import Backoff
from tidegate.fleet import read_heartbeat
from tidegate.lanes import hosted_lanes, pool_queue
from tidegate.records import RESTART_EXIT, AttemptOutcome, EngineStats, Heartbeat, WorkerState
from tidegate.redisconn import StreamsClient
from tidegate.settings import Settings
from workers.context import WorkerContext
from workers.engine import Engine, EngineDead
from workers.faults import StoreFault, TokenHold
from workers.host import EngineHost
from workers.lending import Lender
from workers.metrics import process_metrics
from workers.publisher import EventPublisher
from workers.retry import Retrier
from workers.runner import run_job
from workers.streamer import Streamer

log = logging.getLogger("tidegate.worker")


class Phase(StrEnum):
    STARTING = "starting"  # the engine loads
    READY = "ready"  # serving: the state follows the queues Celery consumes
    DRAINING = "draining"  # Celery is shutting down: no new job, in-flight ones finish
    RESTARTING = "restarting"  # exiting for a fresh process (RESTART_EXIT)
    FAILED = "failed"  # the engine died: out of rotation, exiting for a fresh process


RETIRE_WAIT_S = 10.0  # a failed worker waits this long at most for its jobs to leave it
ENGINE_STOP_S = 5.0  # and this long for what is left of its engine to shut down
CONTROL_TIMEOUT_S = 2.0
KOMBU_BRPOP_S = 1.5  # kombu's Redis consumer blocks in BRPOP this long at most (1 s), and more


class Worker:
    def __init__(self, settings: Settings, name: str, lane: str, pool: str,
                 celery_worker: WorkController) -> None:
        self.settings, self.name, self.lane, self.pool = settings, name, lane, pool
        self.celery_worker = celery_worker  # for the queues it consumes now
        self.pool_queue = pool_queue(settings.lanes[lane], pool)
        self.direct_queue = keys.direct_queue(settings.namespace, name)
        self.boot = uuid.uuid4().hex  # tells a restarted process (same name) from the old
        self.metrics_port = 0  # where it serves /metrics (workers/metrics.py); 0: nowhere
        self.stopped = False
        self.phase = Phase.STARTING
        # Fault injection for health tests and drills: the allocation latency this worker
        # reports instead of the engine's own (None: report the engine's).
        self.forced_alloc_latency_ms: float | None = None
        self.store_fault = StoreFault()  # fault injection: store statements that fail
        self.hold = TokenHold()  # fault injection: a job held mid-generation
        self.redis = redisconn.sync_client(settings.redis_url, **settings.redis_timeouts)
        # Jobs' streams, leases and cancel keys: the same client unless they live apart.
        self.streams: StreamsClient = self.redis if not settings.streams_url else \
            redisconn.sync_streams_client(settings.streams_url, **settings.redis_timeouts)
        self.ctx: WorkerContext | None = None  # set once the engine is loaded and warmed
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # jobs in flight went down
        self._in_flight = 0
        self._outcomes: dict[AttemptOutcome, int] = {}
        self._never = threading.Event()  # what a task left to others waits on: forever
        self._left: set[str] = set()  # ids of the jobs left to other workers
        self.lender: Lender | None = None  # a lending lane's: pulls other lanes' jobs

    # -- engine ----------------------------------------------------------------------

    def load(self, engine: Engine) -> None:
        """Starts the heartbeat, then loads and warms the engine (minutes on a GPU)."""
        Heartbeats(self).start()
        host = EngineHost(engine)
        started = time.monotonic()
        host.start(warm_prompts=["warm up"])
        log.info("engine loaded and warmed in %.1f s", time.monotonic() - started)
        s = self.settings
        publisher = EventPublisher(self.streams, s.namespace, s.stream_maxlen, s.stream_ttl_s)
        store = Store(s.db_url, **s.store_timeouts)
        self.store_fault.install(store)
        streamer = Streamer(self.streams, publisher)
        self.ctx = WorkerContext(name=self.name, namespace=s.namespace, store=store,
                                 redis=self.redis, streams=self.streams, publisher=publisher,
                                 host=host,
                                 lease_ttl_s=keys.lease_ttl_s(s.heartbeat_s),
                                 max_attempts=s.max_attempts, retry=Retrier(s.io_retry_s),
                                 lanes=list(hosted_lanes(s.lanes, self.lane)), hold=self.hold,
                                 metrics=process_metrics().bind(self.name, self.pool),
                                 streamer=streamer)
        streamer.start()
        gcfreeze.after_start()
        CancelListener(self.redis, s.namespace, host).start()
        if s.lanes[self.lane].lend_to:  # work-conserving: take waiting jobs of other lanes
            self.lender = Lender(self)
            self.lender.start()

    @property
    def host(self) -> EngineHost:
        if self.ctx is None:
            raise RuntimeError(f"worker {self.name}: its engine is not loaded yet")
        return self.ctx.host

    def stop(self) -> None:
        self.stopped = True  # the heartbeat thread writes no record after the one removed
        if self.ctx is not None:
            self.ctx.host.stop()
            if self.ctx.streamer is not None:
                self.ctx.streamer.stop()
        self.forget()

    def forget(self) -> None:
        """A clean stop leaves the fleet at once, not when its record expires (a process
        of the same name that already replaced it keeps its own)."""
        key = keys.worker_heartbeat(self.settings.namespace, self.name)
        try:
            hb = read_heartbeat(self.redis, self.settings.namespace, self.name)
            if hb is not None and hb.boot == self.boot:
                self.redis.delete(key)
        except redis.RedisError as exc:
            log.warning("could not remove the heartbeat at stop: %s", exc)

    # -- jobs ------------------------------------------------------------------------

    def run(self, payload: GeneratePayload) -> AttemptOutcome:
        """One generate task; returns its outcome. Never returns once the engine died."""
        ctx = self.ctx
        if ctx is None:
            raise RuntimeError("the engine bootstep has not run: start workers with "
                               "`tidegate worker`")
        job_id = payload.job_id
        if self.phase is Phase.FAILED:  # taken before Celery stopped consuming: not run
            with self._lock:
                self._left.add(job_id)
            self._leave_to_others()
        outcome = AttemptOutcome.ERROR
        with self._lock:
            self._in_flight += 1
        if self.lender is not None:  # counted in flight: no longer a coming borrowed job
            self.lender.started(job_id)
        try:
            outcome = run_job(ctx, payload)
        finally:
            with self._changed:  # left to others before the retiring thread looks
                self._in_flight -= 1
                self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
                if outcome is AttemptOutcome.ENGINE_DEAD:
                    self._left.add(job_id)
                self._changed.notify_all()
        if outcome is AttemptOutcome.ENGINE_DEAD:
            self.engine_died()
            self._leave_to_others()
        return outcome

    def _leave_to_others(self) -> NoReturn:
        """The task never returns, so Celery never acks its message: it stays unacked
        while its job has no lease, which is what the recovery sweep hands back to the
        queue (tasks/recovery.py). The process exits soon."""
        while True:
            self._never.wait()

    def engine_died(self) -> None:
        """Takes the worker out of rotation and restarts it (module docstring). Once."""
        with self._lock:
            if self.phase is Phase.FAILED:
                return
            self.phase = Phase.FAILED
        log.error("worker %s: its engine died; it leaves rotation and restarts", self.name)
        threading.Thread(target=self._retire, name="retire", daemon=True).start()

    def _retire(self) -> None:
        try:
            self.beat()  # `failed` now, not a heartbeat period later
        except redis.RedisError as exc:
            log.warning("could not advertise the failed state: %s", exc)
        stopped = self._stop_consuming()
        quiet_at = time.monotonic() + KOMBU_BRPOP_S
        with self._changed:  # the jobs still running end, or are left to others
            self._changed.wait_for(lambda: self._in_flight == 0, timeout=RETIRE_WAIT_S)
        if stopped:
            # The consumer's last BRPOP, sent before it stopped, still takes from those
            # queues until it returns: a message handed back before then could come back
            # to this process as it exits, and be lost on the way.
            time.sleep(max(0.0, quiet_at - time.monotonic()))
            self._hand_back()
        try:
            self.host.stop(timeout_s=ENGINE_STOP_S)
        except Exception:  # what is left of it dies with the process or its supervisor
            log.exception("shutting down the dead engine failed")
        log.warning("worker process exits to be restarted by its supervisor")
        os._exit(RESTART_EXIT)

    def _hand_back(self) -> None:
        """The messages of the jobs left to others, back to their queues now: the sweep
        with no grace period, for these jobs alone (every other job counts as live)."""
        with self._lock:
            left = set(self._left)
        if not left:
            return
        try:
            restore_orphans(self.celery_worker.app, lambda ids: set(ids) - left, 0.0)
        except Exception:  # the other workers' sweep does it after its grace period
            log.exception("handing back the messages of this worker's jobs failed")

    def _stop_consuming(self) -> bool:
        """Celery's consumer runs in its own thread: asked by a control command to itself.
        True once it consumes nothing."""
        control = self.celery_worker.app.control
        for queue in sorted(self.consumed()):
            try:
                control.cancel_consumer(queue, destination=[self.name], reply=True,
                                        timeout=CONTROL_TIMEOUT_S)
            except Exception as exc:  # the exit stops it anyway
                log.warning("could not stop consuming %s: %s", queue, exc)
        return not self.consumed()

    def counts(self) -> tuple[int, dict[str, int]]:
        """Jobs in flight now, and deliveries so far by outcome."""
        with self._lock:
            return self._in_flight, {k.value: n for k, n in self._outcomes.items()}

    # -- state -----------------------------------------------------------------------

    def consumed(self) -> set[str]:
        consumer = getattr(self.celery_worker, "consumer", None)
        task_consumer = getattr(consumer, "task_consumer", None)
        return {q.name for q in getattr(task_consumer, "queues", [])}

    def state(self) -> WorkerState:
        if self.phase in (Phase.STARTING, Phase.RESTARTING, Phase.FAILED):
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
        try:
            stats = self.ctx.host.engine.stats()
        except EngineDead:  # noticed between jobs, by the heartbeat or a stats command
            self.engine_died()
            return None
        if self.forced_alloc_latency_ms is not None:
            stats = dataclasses.replace(
                stats, avg_cache_allocation_latency_ms=self.forced_alloc_latency_ms)
        return stats

    def heartbeat(self) -> Heartbeat:
        profile = self.settings.lanes[self.lane]
        stats = self.engine_stats()
        return Heartbeat(
            name=self.name, state=self.state(),
            lanes=hosted_lanes(self.settings.lanes, self.lane), pool=self.pool,
            slots=self.settings.engine_slots, queues=(self.pool_queue, self.direct_queue),
            consuming=tuple(sorted(self.consumed())), model=str(self.settings.model_path),
            dtype=profile.dtype,
            # What the engine really runs (an FP8 KV cache may fall back on a CPU).
            kv_cache_dtype=(stats.kv_cache_dtype if stats else "") or profile.kv_cache_dtype,
            lora=tuple(name for name, _ in self.settings.lora), pid=os.getpid(),
            boot=self.boot, host=socket.gethostname(), ts=time.time(),
            engine=self.ctx.host.engine.kind if self.ctx else "", stats=stats,
            mean_job_ms=self.ctx.mean_job_ms if self.ctx else None,
            borrowed=self.ctx.borrowed if self.ctx else 0,
            metrics_port=self.metrics_port,
            capabilities=tuple(sorted(self.ctx.host.engine.capabilities)) if self.ctx else ())

    def beat(self) -> None:
        """Advertises the worker (its heartbeat record, living a few periods)."""
        s = self.settings
        if self.stopped:
            return
        self.redis.set(keys.worker_heartbeat(s.namespace, self.name),
                       self.heartbeat().to_json(), ex=keys.heartbeat_ttl_s(s.heartbeat_s))

    def announce(self) -> None:
        """A heartbeat now, and the fleet told of it (keys.fleet_channel): an activation
        reaches the API's routers (api/fleet.py) and the scheduler at once, not up to a
        heartbeat period later."""
        self.beat()
        self.redis.publish(keys.fleet_channel(self.settings.namespace), self.name)


class Heartbeats(threading.Thread):
    """Advertises the worker and its engine stats, renews the leases of its jobs, and
    (one worker per period) hands dead workers' messages back to their queues."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.worker = worker

    def run(self) -> None:
        period = self.worker.settings.heartbeat_s
        close_s = keys.heartbeat_ttl_s(period) / 2
        last = time.monotonic()
        while True:
            started = time.monotonic()
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            except Exception:  # a bug in one beat must not end the heartbeat
                log.exception("heartbeat failed")
            now = time.monotonic()
            if now - last > close_s:  # the record came close to expiring: say why
                log.warning("heartbeat late: %.1f s since the last one (this beat took %.1f s, "
                            "the period is %.1f s)", now - last, now - started, period)
            last = now
            time.sleep(period)

    def beat(self) -> None:
        w, s = self.worker, self.worker.settings
        ttl = keys.heartbeat_ttl_s(s.heartbeat_s)
        w.beat()
        if w.ctx is None:
            return
        for lease in w.ctx.held_leases():
            lease.renew()
        if w.phase is Phase.FAILED:  # the sweep would hand its own jobs back to it
            return
        period = int(time.time() / s.heartbeat_s)
        if locks.take_period(w.redis, keys.scheduler_lock(s.namespace, "recover", period),
                             s.heartbeat_s, ttl_s=ttl, owner=w.name):
            try:
                self.recover()
            except Exception:  # a failed sweep must not stop the heartbeat; the next retries
                log.exception("the sweep for a dead worker's messages failed")

    def recover(self) -> None:
        """A message whose job has no lease for longer than a lease lives has lost its
        worker (workers/lease.py, tasks/recovery.py)."""
        w = self.worker
        grace_s = keys.lease_ttl_s(w.settings.heartbeat_s)
        restored = restore_orphans(w.celery_worker.app, self.leased, grace_s)
        process_metrics().recovered(len(restored))

    def leased(self, job_ids: list[str]) -> set[str]:
        """The jobs that an attempt holds now (their lease exists), in one round trip."""
        ns, pipe = self.worker.settings.namespace, self.worker.streams.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(keys.job_lease(ns, job_id))
        return {job_id for job_id, n in zip(job_ids, pipe.execute(), strict=True) if n}


class CancelListener(threading.Thread):
    """Aborts engine requests whose job was cancelled (ids broadcast on one channel)."""

    def __init__(self, client: redis.Redis, namespace: str, host: EngineHost) -> None:
        super().__init__(name="cancel-listener", daemon=True)
        self.r, self.ns, self.host = client, namespace, host

    def run(self) -> None:
        backoff = Backoff()
        while True:  # resubscribe after a dropped connection
            try:
                pubsub = self.r.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(keys.cancel_channel(self.ns))
                backoff.reset()
                while True:
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None:
                        job_id = message["data"].decode()
                        log.info("cancel of job %s received", job_id,
                                 extra={"job_id": job_id})
                        self.host.cancel(job_id)
            except redis.RedisError as exc:
                wait_s = backoff.next_s()
                log.warning("cancel listener lost Redis (%s); resubscribing in %.1f s", exc,
                            wait_s)
                # Cancels missed meanwhile are not lost: each job's task thread and the
                # streamer poll its cancel key too (workers/job_stream.py).
                time.sleep(wait_s)


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
