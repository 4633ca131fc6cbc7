"""The worker process's entry: `tidegate worker --lane chat --gpu 0` checks its options,
pins its device and CPU priority, then runs Celery's worker with the threads pool (one
thread per engine slot) and the hooks of workers/celery_setup.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import tempfile
from pathlib import Path

from celery import Celery

from tasks.app import run_celery
from tasks.payloads import GENERATE
from tidegate import keys, logs
from tidegate.lanes import lendable_slots, pool_queue
from tidegate.niceness import lower_cpu_priority
from tidegate.settings import Settings, get_settings
from workers import celery_setup
from workers import metrics as worker_metrics
from workers.bootsteps import ENGINES

log = logging.getLogger("tidegate.worker")


def engine_logs_like_ours(settings: Settings) -> None:
    """vLLM configures its own `vllm` logger, in this process and in each process it
    starts (its engine core), from the dictConfig file VLLM_LOGGING_CONFIG_PATH names:
    this process's format, written to a file named after its content. Progress bars
    (tqdm, the Hugging Face hub's) and PyTorch's C++ warnings are no log lines: off."""
    config = logs.dict_config(settings, "worker", job_tasks=[GENERATE],
                              loggers={"vllm": settings.log_level.upper()})
    text = json.dumps(config, sort_keys=True)
    path = Path(tempfile.gettempdir()) / \
        f"tidegate-vllm-logging-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(path)  # whole, for an engine core reading it at once
    os.environ.update({"VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_CONFIG_PATH": str(path),
                       "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       # PyTorch's C++ warnings print straight to stderr, past logging.
                       "TORCH_CPP_LOG_LEVEL": "ERROR"})


# Celery's line for each task received ("Task ... received"), at INFO: 3.3% of a worker's
# CPU under load (bench/README.md, "fourth round"), and nothing its "succeeded" line and
# the task-received event (Flower) do not already say. Warnings and errors still come,
# and TIDEGATE_LOG_LEVEL=debug brings it back.
QUIET_LOGGERS = {"celery.worker.strategy": "WARNING"}


def metrics_port_of(settings: Settings, gpu: str | None,
                    metrics_port: int | None) -> tuple[int, int]:
    """The port this worker serves /metrics on (0: none), bound now, before the engine
    loads, so a taken port costs no engine load; and the port it preferred. `--metrics-port`
    names the port exactly; else the setting's port plus the GPU index, or the next free
    one (workers/metrics.py `reserve`): workers on one machine need no flag."""
    host = settings.metrics_host
    if metrics_port is not None:
        return (worker_metrics.reserve(host, metrics_port, exact=True) if metrics_port
                else 0), metrics_port
    if not settings.worker_metrics_port:
        return 0, 0
    preferred = worker_metrics.preferred_port(settings.worker_metrics_port, gpu)
    return worker_metrics.reserve(host, preferred, exact=False), preferred


def run_worker(celery_app: Celery, lane: str, gpu: str | None, name: str | None,
               loglevel: str = "INFO", pool: str | None = None, engine: str = "vllm",
               standby: bool = False, cpus: str | None = None,
               metrics_port: int | None = None) -> None:
    settings = get_settings()
    if lane not in settings.lanes:
        raise SystemExit(f"tidegate worker: unknown lane {lane!r}; lanes: {sorted(settings.lanes)}")
    if engine not in ENGINES:
        raise SystemExit(f"tidegate worker: unknown engine {engine!r}; "
                         f"engines: {ENGINES}")
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
    port, preferred = metrics_port_of(settings, gpu, metrics_port)
    logs.set_process_fields(worker=name)
    quiet = settings.log_level.upper() != "DEBUG"
    logs.setup_logging(settings, "worker", job_tasks=[GENERATE],
                       loggers=QUIET_LOGGERS if quiet else None)
    if port != preferred:
        log.warning("metrics port %d is taken: this worker serves /metrics on %d once its "
                    "engine is loaded (in its heartbeat and `tidegate status`)", preferred, port)
    engine_logs_like_ours(settings)
    lower_cpu_priority(settings.lanes[lane].cpu_nice, "the lane's cpu_nice")
    celery_setup.register(celery_app, settings)
    queues = [keys.direct_queue(settings.namespace, name)]
    if not standby:  # a standby worker: engine loaded and warmed, its direct queue only
        queues.insert(0, pool_queue(settings.lanes[lane], pool))
    # A lending lane's worker holds a thread for each slot it may lend beyond its own: a
    # task thread runs a job from its message to its end, and its own lane's arrival must
    # find a thread free to reach the engine and take its slot back from a borrowed job.
    # (Its own jobs beyond its slots then wait in its engine, in arrival order, not in
    # Redis: at most the lendable count of them.)
    threads = settings.engine_slots + lendable_slots(settings.lanes[lane], settings.engine_slots)
    run_celery(celery_app, [
        "worker", "-P", "threads", "-c", str(threads),
        "--prefetch-multiplier", "1", "-Q", ",".join(queues), "-n", name,
        "--loglevel", loglevel, "--without-gossip", "--without-mingle",
        f"--tidegate-lane={lane}", f"--tidegate-pool={pool}", f"--tidegate-engine={engine}",
        f"--tidegate-metrics-port={port}",
    ])
