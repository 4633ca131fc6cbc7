"""Prometheus metrics of one worker process, served on its own port beside its engine's
native ones. The port: `tidegate worker --metrics-port` exactly; else
TIDEGATE_WORKER_METRICS_PORT (9400) plus the worker's `--gpu` index, or the next free port
above it when another process holds it (announced in the heartbeat and `tidegate status`);
taken or not, it is settled before the engine loads (`reserve`). vLLM's `AsyncLLM`
registers its `vllm:*` metrics in prometheus_client's default registry of the process that
holds it, this one, and the server serves both.

Names, units and meanings follow vLLM's where they coincide (`vllm:time_to_first_token_
seconds` -> `tidegate_time_to_first_token_seconds`), but tidegate's are measured around the
whole job: queue time from the API's enqueue, TTFT from the worker's start of the job.
Labels: lane, pool, worker; never a job or tenant id. Job figures are observed when the
worker ends a job (workers/runner.py); engine gauges and the worker's state are read from
the engine when Prometheus scrapes.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Protocol
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from store import JobRecord
from tidegate.records import EngineStats, WorkerState

log = logging.getLogger("tidegate.worker")

disable_created_metrics()  # `_created` series: twice the series, read by nothing

# vLLM's own buckets (vllm/v1/metrics/loggers.py), so the two histograms compare bucket
# for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ("lane", "pool", "worker")


class WorkerMetrics:
    """The process's registry and the job metrics the runner observes."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.queue_time = Histogram(
            "tidegate_request_queue_time_seconds", "Time from the API's enqueue to the "
            "worker starting the job", LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "tidegate_time_to_first_token_seconds", "Time from the worker starting the job "
            "to its first token", LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "tidegate_inter_token_latency_seconds", "Time per output token after the first "
            "(TPOT), one observation per job", LABELS, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "tidegate_e2e_request_latency_seconds", "Time from the API's enqueue to the job's "
            "end", LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tidegate_prompt_tokens_total", "Prompt tokens of the "
                                     "jobs this worker ran", LABELS, registry=r)
        self.generation_tokens = Counter("tidegate_generation_tokens_total", "Tokens this "
                                         "worker generated", LABELS, registry=r)
        self.finished = Counter("tidegate_jobs_finished_total", "Jobs this worker ended, by "
                                "status (done, error, cancelled, expired)",
                                (*LABELS, "status"), registry=r)
        self.resumed = Counter("tidegate_jobs_resumed_total", "Jobs this worker took over "
                               "after a dead worker's attempt (attempt > 1)", LABELS,
                               registry=r)
        self.poison = Counter("tidegate_poison_jobs_total", "Jobs this worker ended `error` "
                              "(code poison): taken up more than max_attempts times",
                              LABELS, registry=r)
        # The usage ledger's tokens (store/usage.py) by lane and kind, never by tenant (a
        # label per tenant is unbounded): the ended jobs' rows, counted by the worker that
        # ended them. The ledger itself (GET /admin/v1/usage) is the exact, per tenant one.
        self.usage_tokens = Counter("tidegate_usage_tokens_total", "Tokens of the jobs this "
                                    "worker ended, as the usage ledger counts them, by kind "
                                    "(prompt, cached, completion)", ["lane", "kind"],
                                    registry=r)
        self.recoveries = Counter("tidegate_recoveries_total", "Dead workers' messages this "
                                  "worker's recovery sweep handed back (action: restored)",
                                  ["action"], registry=r)

    def recovered(self, messages: int) -> None:
        """This worker's recovery sweep handed dead workers' messages back to their queues
        (tasks/recovery.py); the scheduler's reconciler counts its own actions."""
        if messages:
            self.recoveries.labels("restored").inc(messages)

    def bind(self, worker: str, pool: str) -> JobMetrics:
        return JobMetrics(self, worker, pool)


class JobMetrics:
    """The job metrics of one worker: the runner passes the job's lane, nothing more."""

    def __init__(self, metrics: WorkerMetrics, worker: str, pool: str) -> None:
        self.m, self.worker, self.pool = metrics, worker, pool

    def _labels(self, lane: str) -> tuple[str, str, str]:
        return lane, self.pool, self.worker

    def taken(self, lane: str, attempt: int) -> None:
        """An attempt took the job; past the first, it resumes a dead worker's job."""
        if attempt > 1:
            self.m.resumed.labels(*self._labels(lane)).inc()

    def prefilled(self, lane: str, prompt_tokens: int) -> None:
        """An attempt hands the job's prompt to the engine (again, on a resume)."""
        self.m.prompt_tokens.labels(*self._labels(lane)).inc(prompt_tokens)

    def generated(self, lane: str, tokens: int) -> None:
        self.m.generation_tokens.labels(*self._labels(lane)).inc(tokens)

    def poisoned(self, lane: str) -> None:
        self.m.poison.labels(*self._labels(lane)).inc()

    def ended(self, lane: str, status: str, job: JobRecord | None) -> None:
        """The job's terminal row is written: its status, and the timings its row holds
        (a job cancelled while queued has none)."""
        labels = self._labels(lane)
        self.m.finished.labels(*labels, status).inc()
        if job is None:
            return
        self._usage(lane, job)
        for hist, ms in ((self.m.queue_time, job.queue_wait_ms), (self.m.ttft, job.ttft_ms),
                         (self.m.itl, job.tpot_ms)):
            if ms is not None:
                hist.labels(*labels).observe(ms / 1000)
        if job.finished_at and job.enqueued_at:
            self.m.e2e.labels(*labels).observe(
                (job.finished_at - job.enqueued_at).total_seconds())

    def _usage(self, lane: str, job: JobRecord) -> None:
        # As the ledger counts a row: prompt tokens once a worker took the job.
        prompt = job.prompt_tokens if job.started_at is not None else 0
        for kind, tokens in (("prompt", prompt), ("cached", job.cached_tokens),
                             ("completion", job.completion_tokens)):
            if tokens:
                self.m.usage_tokens.labels(lane, kind).inc(tokens)


_process: WorkerMetrics | None = None


def process_metrics() -> WorkerMetrics:
    """This process's metrics (one worker per process)."""
    global _process
    if _process is None:
        _process = WorkerMetrics()
    return _process


# name, help, EngineStats field, scale; a gauge of the engine's figures at scrape time
_ENGINE_GAUGES = (
    ("tidegate_num_requests_running", "Sequences the engine is running", "running", 1.0),
    ("tidegate_num_requests_waiting", "Sequences waiting in the engine", "waiting", 1.0),
    ("tidegate_kv_cache_usage_perc", "Fraction (0-1) of KV cache blocks in use", "kv_usage",
     1.0),
    ("tidegate_cache_allocation_latency_seconds", "Time per engine step spent allocating KV "
     "cache, recent average (the health check's threshold: alloc_latency_threshold_ms)",
     "avg_cache_allocation_latency_ms", 0.001),
)
# The engine's running totals, since it started: counters, as vLLM exposes them.
_ENGINE_COUNTERS = (
    ("tidegate_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
     "prefix_queries_tokens"),
    ("tidegate_prefix_cache_hits", "Prompt tokens found in the prefix cache",
     "prefix_hits_tokens"),
)


class ScrapedWorker(Protocol):
    """What a scrape reads of the process's Worker (workers/worker.py)."""

    lane: str
    pool: str
    name: str

    def engine_stats(self) -> EngineStats | None: ...

    def state(self) -> WorkerState: ...


class WorkerCollector(Collector):
    """The worker's state and its engine's figures, read when Prometheus scrapes.
    `worker()` is the process's Worker (workers/worker.py), None before it is built."""

    def __init__(self, worker: Callable[[], ScrapedWorker | None]) -> None:
        self.worker = worker

    def collect(self) -> Iterable[Metric]:
        w = self.worker()
        labels = [w.lane, w.pool, w.name] if w is not None else []
        stats: EngineStats | None = w.engine_stats() if w is not None else None
        for name, doc, field, scale in _ENGINE_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            value = getattr(stats, field, None)
            if isinstance(value, int | float):
                gauge.add_metric(labels, float(value) * scale)
            yield gauge
        for name, doc, field in _ENGINE_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            if stats is not None:
                counter.add_metric(labels, float(getattr(stats, field)))
            yield counter
        yield self._state(w, labels)

    @staticmethod
    def _state(w: ScrapedWorker | None, labels: list[str]) -> Metric:
        gauge = GaugeMetricFamily("tidegate_worker_state", "1 for the worker's current state, "
                                  "0 for the others", labels=[*LABELS, "state"])
        if w is not None:
            now = w.state()
            for state in WorkerState:
                gauge.add_metric([*labels, state.value], 1.0 if state == now else 0.0)
        return gauge


PORT_SCAN = 100  # ports tried upward from a worker's preferred one, when it is taken

# The socket reserve() bound, listening before the engine loads; serve() serves on it.
_reserved: socket.socket | None = None


def preferred_port(base: int, gpu: str | None) -> int:
    """The port a worker tries first: `base` plus its GPU index (`--gpu 2`: base + 2; of a
    list, the first), so each GPU's worker on a machine has a port of its own; `base`
    without a numeric GPU index."""
    first = (gpu or "").split(",")[0].strip()
    return base + int(first) if first.isdigit() else base


def reserve(host: str, port: int, *, exact: bool) -> int:
    """Binds and listens on the worker's metrics socket now, before minutes of engine
    loading, and returns its port; serve() serves on it once the engine is loaded.

    exact (a port the operator named, `--metrics-port`): that port, or the process stops
    naming it. Otherwise the first free port from `port` upward (PORT_SCAN of them): a
    second worker on a machine takes the next one, and says so (its heartbeat and
    `tidegate status` show it). Any other bind error (an address not on this machine)
    stops the process at once, as a taken exact port does.

    Listening at once, not only bound: Linux lets two sockets with SO_REUSEADDR bind one
    port while neither listens, so two workers starting together could both take it.
    The engine core inherits no socket: vLLM spawns it, and Python's sockets close on exec.
    """
    global _reserved
    last = f"{host}:{port} (not a port)"
    for candidate in [port] if exact else range(port, min(port + PORT_SCAN, 65536)):
        try:
            _reserved = _listen(host, candidate)
            return candidate
        except OSError as exc:
            last = f"{host}:{candidate} ({exc.strerror})"
            if exc.errno != errno.EADDRINUSE:
                break
    what = "" if exact else f" or any of the {PORT_SCAN - 1} ports above it"
    raise SystemExit(f"tidegate worker: cannot serve /metrics on {last}{what}; set the "
                     "port with TIDEGATE_WORKER_METRICS_PORT or --metrics-port (0: off)")


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        # A restarted worker takes its port back past the old one's TIME_WAIT connections.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def serve(host: str, port: int, worker: Callable[[], ScrapedWorker | None]) -> None:
    """Serves /metrics on host:port: tidegate's worker metrics and the default registry
    (the engine's native metrics, the process's own). On the socket reserve() holds for
    that port, else on a new one."""
    global _reserved
    sock = _reserved if _reserved is not None and _reserved.getsockname()[1] == port \
        else _listen(host, port)
    _reserved = None
    metrics = process_metrics()
    metrics.registry.register(WorkerCollector(worker))
    metrics.registry.register(REGISTRY)  # collected at each scrape: vLLM registers later
    _serve_on(sock, metrics.registry)
    log.info("worker metrics on http://%s:%d/metrics", host, port)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        """No line per scrape (prometheus_client's own server logs none either)."""


def _serve_on(sock: socket.socket, registry: CollectorRegistry) -> None:
    """prometheus_client's threaded WSGI server and app, on a socket already listening
    (its start_http_server binds one of its own)."""
    server = ThreadingWSGIServer(sock.getsockname()[:2], _QuietHandler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_address = sock.getsockname()
    server.server_name, server.server_port = str(sock.getsockname()[0]), sock.getsockname()[1]
    server.setup_environ()
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
