"""The engine bootstep: builds the process's `Worker`, loads and warms its engine before
the consumer takes any task, and stops it with the worker."""

from __future__ import annotations

from celery import Celery, bootsteps
from celery.backends.base import DisabledBackend
from celery.worker import WorkController

from tasks.payloads import GENERATE
from tidegate import tracing
from tidegate.lanes import Lane, hosted_lanes
from tidegate.settings import get_settings
from workers import broker
from workers import metrics as worker_metrics
from workers.engine import Engine, EngineConfig
from workers.worker import Worker, current, set_current

ENGINES = ("vllm", "trtllm", "sim")  # sim: no model, GPU timings (workers/sim_engine.py)
OPTIONS = ("lane", "pool", "engine", "metrics-port")  # `--tidegate-<option>`, to EngineStep


def _tool_parsers(lanes: dict[str, Lane], lane: str) -> tuple[str, ...]:
    """The tool parsers of the lane and of every lane that runs on its workers."""
    names = (lanes[name].tool_parser for name in hosted_lanes(lanes, lane))
    return tuple(sorted({name for name in names if name is not None}))


def make_engine(lane: str, kind: str) -> Engine:
    settings = get_settings()
    profile = settings.lanes[lane]
    config = EngineConfig(
        model=str(settings.model_path), dtype=profile.dtype,
        kv_cache_dtype=profile.kv_cache_dtype, max_model_len=settings.max_model_len,
        slots=settings.engine_slots, kv_cache_gib=settings.kv_cache_gib,
        cpu_executor=settings.vllm_cpu_executor,
        quantization=profile.quantization, lora_adapters=settings.lora,
        kv_policy=settings.kv_policy, kv_params=profile.kv_policy,
        kv_cache_blocks=settings.kv_cache_blocks or None,
        kv_block_size=settings.kv_block_size or None,
        cuda_graphs=profile.cuda_graphs,
        tool_parsers=_tool_parsers(settings.lanes, lane),
    )
    if kind == "trtllm":
        from workers.trtllm_engine import TrtllmEngine

        return TrtllmEngine(config)
    if kind == "sim":
        from workers.sim_engine import SimEngine

        # On a replay clock the profile's load and activation times play, compressed.
        scale = settings.replay_speedup if settings.clock.replay else None
        return SimEngine(config, profile=settings.sim_profile, startup_scale=scale)
    from workers.vllm_engine import VllmEngine

    return VllmEngine(config)


class EngineStep(bootsteps.StartStopStep):
    """Loads and warms the engine before the consumer takes any task."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: WorkController, tidegate_lane: str = "chat",
                 tidegate_pool: str = "", tidegate_engine: str = "vllm",
                 tidegate_metrics_port: str = "", **kwargs: object) -> None:
        super().__init__(worker, **kwargs)  # kwargs: Celery's own step options
        self.lane, self.engine = tidegate_lane, tidegate_engine
        self.pool = tidegate_pool or tidegate_engine
        self.metrics_port = int(tidegate_metrics_port or 0)  # 0: no /metrics

    def start(self, worker: WorkController) -> None:
        share_result_backend(worker.app)
        me = Worker(get_settings(), worker.hostname, self.lane, self.pool, worker)
        me.metrics_port = self.metrics_port  # announced in its heartbeat from the first beat
        set_current(me)
        me.load(make_engine(self.lane, self.engine))
        # After the engine's load, so its engine-core process starts without the exporter.
        tracing.setup_tracing(get_settings(), "tidegate-worker")
        if self.metrics_port:  # on the socket bound before the load (workers/metrics.py)
            worker_metrics.serve(get_settings().metrics_host, self.metrics_port, lambda: me)

    def stop(self, worker: WorkController) -> None:
        current().stop()
        broker.ACKS.flush()  # the acks still waiting go out before the process ends


def share_result_backend(app: Celery) -> None:
    """One result backend for the generate task in every pool thread. The app has none
    (task_ignore_result: job state lives in the store), but Celery still looks one up in
    each new task thread (its backends are thread-local unless thread-safe), and the look-up
    reads every installed package's entry points: 6.6% of a worker's CPU while its pool
    grew under load (bench/README.md, "fourth round"). The disabled backend holds no
    state, so one serves every thread; a backend configured on purpose is left per thread."""
    backend = app.backend
    if isinstance(backend, DisabledBackend):
        app.tasks[GENERATE].backend = backend
