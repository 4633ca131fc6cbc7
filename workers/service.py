"""The worker process: Celery bootstep that loads the engine before the consumer starts,
the generate task registered under its contract name, heartbeats, cancel listener and
control commands.

Run with `tidegate worker --lane chat --gpu 0`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import click
import redis
from celery import Celery, bootsteps
from celery.signals import worker_ready, worker_shutting_down
from celery.worker.control import inspect_command

from store import Store
from tasks.app import app, direct_queue
from tasks.payloads import GENERATE
from tidegate import keys
from tidegate.lanes import pool_queue
from tidegate.settings import Settings, get_settings
from workers.engine import Engine, EngineConfig, EngineStats
from workers.host import EngineHost
from workers.lifecycle import LIFECYCLE
from workers.publisher import EventPublisher
from workers.runner import WorkerContext, run_job

log = logging.getLogger("tidegate.worker")

_ctx: WorkerContext | None = None
BOOT_ID = uuid.uuid4().hex  # tells a restarted process (same pid after exec) from the old
_outcomes_lock = threading.Lock()
_in_flight = [0]  # generate tasks running now, under _outcomes_lock


def context() -> WorkerContext:
    if _ctx is None:
        raise RuntimeError("the engine bootstep has not run: start workers with `tidegate worker`")
    return _ctx


@app.task(name=GENERATE, bind=True, acks_late=True)
def generate(self: Any, body: dict[str, Any]) -> str:
    ctx = context()
    with _outcomes_lock:
        _in_flight[0] += 1
    try:
        outcome = run_job(ctx, body)
    finally:
        with _outcomes_lock:
            _in_flight[0] -= 1
    with _outcomes_lock:
        ctx.outcomes[outcome] = ctx.outcomes.get(outcome, 0) + 1
    return outcome


def worker_state() -> str:
    with _outcomes_lock:
        return LIFECYCLE.state(_in_flight[0])


ENGINES = ("vllm", "trtllm")


def make_engine(settings: Settings, lane: str, kind: str) -> Engine:
    profile = settings.lanes[lane]
    config = EngineConfig(
        model=str(settings.model_path), dtype=profile.dtype,
        kv_cache_dtype=profile.kv_cache_dtype, max_model_len=settings.max_model_len,
        slots=settings.engine_slots, kv_cache_gib=settings.kv_cache_gib,
        quantization=profile.quantization, lora_adapters=settings.lora,
        kv_policy=settings.kv_policy, kv_params=profile.kv_policy,
        kv_cache_blocks=settings.kv_cache_blocks or None,
        kv_block_size=settings.kv_block_size or None,
    )
    if kind == "trtllm":
        from workers.trtllm_engine import TrtllmEngine

        return TrtllmEngine(config)
    from workers.vllm_engine import VllmEngine

    return VllmEngine(config)


class EngineStep(bootsteps.StartStopStep):
    """Loads and warms the engine before the consumer takes any task."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, tidegate_lane: str = "chat", tidegate_pool: str = "",
                 tidegate_engine: str = "vllm", **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.lane, self.engine = tidegate_lane, tidegate_engine
        self.pool = tidegate_pool or tidegate_engine

    def start(self, worker: Any) -> None:
        global _ctx
        settings = get_settings()
        name = worker.hostname
        LIFECYCLE.worker = worker
        LIFECYCLE.pool_queue = pool_queue(settings.lanes[self.lane], self.pool)
        client = redis.Redis.from_url(settings.redis_url)
        hb = Heartbeat(settings, name, self.lane, self.pool, client)
        hb.start()
        host = EngineHost(make_engine(settings, self.lane, self.engine))
        t0 = time.monotonic()
        host.start(warm_prompts=["warm up"])
        log.info("engine loaded and warmed in %.1f s", time.monotonic() - t0)
        publisher = EventPublisher(client, settings.namespace, settings.stream_maxlen,
                                   settings.stream_ttl_s)
        _ctx = WorkerContext(name=name, namespace=settings.namespace, store=Store(settings.db_url),
                             redis=client, publisher=publisher, host=host, lanes=[self.lane])
        hb.ctx = _ctx
        CancelListener(client, settings.namespace, host).start()

    def stop(self, worker: Any) -> None:
        if _ctx is not None:
            _ctx.host.stop()


class Heartbeat(threading.Thread):
    """Advertises this worker and its engine stats; renews leases of running jobs."""

    def __init__(self, settings: Settings, name: str, lane: str, pool: str,
                 client: redis.Redis) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.settings, self.name, self.lane, self.r = settings, name, lane, client
        self.pool = pool
        self.ctx: WorkerContext | None = None

    def run(self) -> None:
        while True:
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            time.sleep(self.settings.heartbeat_s)

    def beat(self) -> None:
        ns = self.settings.namespace
        ttl = int(self.settings.heartbeat_s * 5) + 1
        self.r.set(keys.worker_heartbeat(ns, self.name), json.dumps(self.payload()), ex=ttl)
        if self.ctx is not None:
            for job_id in self.ctx.host.running_ids():
                self.r.expire(keys.job_lease(ns, job_id), keys.LEASE_TTL_S)

    def payload(self) -> dict[str, Any]:
        profile = self.settings.lanes[self.lane]
        body: dict[str, Any] = {
            "name": self.name, "state": worker_state(), "lanes": [self.lane],
            "consuming": sorted(LIFECYCLE.consumed()),
            "pool": self.pool, "queues": worker_queues(self.settings, self.lane, self.pool,
                                                        self.name),
            "model": str(self.settings.model_path), "dtype": profile.dtype,
            "kv_cache_dtype": profile.kv_cache_dtype, "slots": self.settings.engine_slots,
            "lora": [name for name, _ in self.settings.lora],
            "pid": os.getpid(), "boot": BOOT_ID, "host": socket.gethostname(),
            "ts": time.time(),
        }
        if self.ctx is not None:
            stats = self.ctx.host.engine.stats()
            body["engine"] = self.ctx.host.engine.kind
            # What the engine really runs (an FP8 KV cache may fall back on a CPU).
            body["kv_cache_dtype"] = stats.kv_cache_dtype or profile.kv_cache_dtype
            body["stats"] = {**stats.__dict__, "prefix_hit_rate": stats.prefix_hit_rate,
                             "avg_cache_allocation_latency_ms": _alloc_latency_ms(stats)}
            body["mean_job_ms"] = self.ctx.mean_job_ms
        return body


def _alloc_latency_ms(stats: EngineStats) -> float | None:
    forced = LIFECYCLE.forced_alloc_latency_ms
    return forced if forced is not None else stats.avg_cache_allocation_latency_ms


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


@inspect_command(name="tidegate_stats")
def tidegate_stats(state: Any) -> dict[str, Any]:
    """Engine stats on demand: `app.control.broadcast('tidegate_stats', reply=True)`."""
    stats = context().host.engine.stats()
    ctx = context()
    with _outcomes_lock:
        outcomes, in_flight = dict(ctx.outcomes), _in_flight[0]
    return {**stats.__dict__, "prefix_hit_rate": stats.prefix_hit_rate, "state": worker_state(),
            "outcomes": outcomes, "in_flight": in_flight,
            "avg_cache_allocation_latency_ms": _alloc_latency_ms(stats)}


@worker_ready.connect
def _ready(**_: Any) -> None:
    LIFECYCLE.phase = "ready"


@worker_shutting_down.connect
def _draining(**_: Any) -> None:
    LIFECYCLE.phase = "draining"


def worker_queues(settings: Settings, lane: str, pool: str, name: str) -> list[str]:
    return [pool_queue(settings.lanes[lane], pool), direct_queue(settings, name)]


def lower_cpu_priority(nice: int) -> None:
    """This process at niceness `nice`, before its threads and engine process start (both
    inherit it). Linux keeps a niceness per thread, so threads already running are set one
    by one. Only ever lowers the priority: raising it needs privileges."""
    if nice <= os.getpriority(os.PRIO_PROCESS, 0):
        return
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") \
        else [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    log.info("CPU priority lowered to niceness %d (the lane's cpu_nice)", nice)
    _session_nice(nice)


AUTOGROUP = Path("/proc/self/autogroup")


def _session_nice(nice: int) -> None:
    """Linux's autogroup scheduling shares the CPU between sessions first, so a niceness
    only counts against processes of the same session: a worker in a session of its own
    (tidegate's process tools, systemd and containers start it so) sets its session's
    niceness too. In someone else's session (a shell's) that would slow the rest of it:
    left alone, and said."""
    if not AUTOGROUP.exists():
        return
    if os.getsid(0) not in (os.getpid(), os.getppid()):  # the supervisor leads its own
        log.warning("cpu_nice %d counts only against this session's processes: start the "
                    "worker in a session of its own (setsid) for it to count against others",
                    nice)
        return
    try:
        AUTOGROUP.write_text(str(nice))
    except OSError as exc:
        log.warning("could not set this session's niceness to %d: %s", nice, exc)


def run_worker(celery_app: Celery, lane: str, gpu: str | None, name: str | None,
               loglevel: str = "INFO", pool: str | None = None, engine: str = "vllm",
               standby: bool = False, cpus: str | None = None) -> None:
    settings = get_settings()
    if lane not in settings.lanes:
        raise SystemExit(f"tidegate worker: unknown lane {lane!r}; lanes: {sorted(settings.lanes)}")
    if engine not in ENGINES:
        raise SystemExit(f"tidegate worker: unknown engine {engine!r}; engines: {ENGINES}")
    pool = pool or engine
    if pool not in settings.lanes[lane].pools:
        raise SystemExit(f"tidegate worker: lane {lane!r} takes no jobs from pool {pool!r}; "
                         f"its pools: {settings.lanes[lane].pools}")
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before the engine import sees CUDA
    if cpus is not None:
        # The CPU build's pinning: its engine binds its threads to these cores. Left to
        # itself, every engine on a machine binds to the same first core.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    name = name or f"{lane}-{gpu or 'cpu'}-{os.getpid()}@{socket.gethostname()}"
    lower_cpu_priority(settings.lanes[lane].cpu_nice)
    celery_app.steps["worker"].add(EngineStep)
    # Celery's own option parser learns `--tidegate-lane`; EngineStep receives it.
    for option in ("lane", "pool", "engine"):
        celery_app.user_options["worker"].add(
            click.Option((f"--tidegate-{option}",), default="", help=f"tidegate {option}"))
    queues = worker_queues(settings, lane, pool, name)
    if standby:  # engine loaded and warmed, but only the direct queue until activated
        queues = queues[1:]
    celery_app.worker_main([
        "worker", "-P", "threads", "-c", str(settings.engine_slots),
        "--prefetch-multiplier", "1", "-Q", ",".join(queues), "-n", name,
        "--loglevel", loglevel, "--without-gossip", "--without-mingle",
        f"--tidegate-lane={lane}", f"--tidegate-pool={pool}", f"--tidegate-engine={engine}",
    ])
