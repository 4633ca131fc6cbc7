"""Prometheus metrics of the scheduler process: fleet-wide facts no single worker or API
replica knows, served on `TIDEGATE_SCHEDULER_METRICS_PORT`. Gauges are read from Redis and
the store when Prometheus scrapes; with two scheduler replicas both serve the same values
(dashboards take `max()`), and each counts only the recoveries its own reconciler made.

Queue depth is kombu's: one Redis list per priority step of each pool queue of a lane
(tidegate/keys.py); a lane that runs on another's workers (`runs_on`) shares that lane's
queues, so its messages are counted there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

import redis
from prometheus_client import (
    CollectorRegistry,
    Counter,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from store import Store
from store.webhooks import Webhooks
from tasks.app import queue_lengths_by_step
from tidegate.fleet import read_fleet
from tidegate.lanes import PRIORITY_MAX, Lane, pool_queue
from tidegate.records import ACTIVE_STATUSES, WorkerState
from tidegate.settings import Settings

log = logging.getLogger("tidegate.scheduler")

disable_created_metrics()  # `_created` series: twice the series, read by nothing

REGISTRY = CollectorRegistry()
RECOVERIES = Counter("tidegate_recoveries_total", "Reconciler actions of this scheduler "
                     "(requeue, expired, lost, ended_cancelled, moved_stranded, ...)",
                     ["action"], registry=REGISTRY)


def count_recovery(action: Mapping[str, object]) -> None:
    RECOVERIES.labels(str(action.get("action", "unknown"))).inc()


class SchedulerCollector(Collector):
    """Queue depth, jobs in flight, workers by state, lane objectives and the webhook
    backlog, read at scrape time."""

    def __init__(self, settings: Settings, client: redis.Redis, store: Store) -> None:
        self.settings, self.client, self.store = settings, client, store
        self.webhooks = Webhooks(store)

    def queue_owners(self) -> list[Lane]:
        return [lane for lane in self.settings.lanes.values() if lane.runs_on is None]

    def collect(self) -> Iterable[Metric]:
        yield self._queue_depth()
        yield self._in_flight()
        yield self._workers()
        yield self._objectives()
        yield from self._webhooks()

    def _queue_depth(self) -> Metric:
        gauge = GaugeMetricFamily("tidegate_queue_depth", "Messages waiting in the lane's "
                                  "pool queues, by public priority (9 the most urgent)",
                                  labels=["lane", "priority"])
        lanes = self.queue_owners()
        by_step = queue_lengths_by_step(
            self.client, [pool_queue(lane, pool) for lane in lanes for pool in lane.pools])
        for lane in lanes:
            depth = [sum(steps) for steps in zip(*(by_step[pool_queue(lane, pool)]
                                                   for pool in lane.pools), strict=True)]
            for step, waiting in enumerate(depth):  # Redis step 0 is public priority 9
                gauge.add_metric([lane.name, str(PRIORITY_MAX - step)], waiting)
        return gauge

    def _in_flight(self) -> Metric:
        gauge = GaugeMetricFamily("tidegate_jobs_in_flight", "Jobs queued or running, from "
                                  "the store", labels=["lane", "status"])
        counts = self.store.jobs.in_flight_by_lane()
        for lane in self.settings.lanes:
            for status in sorted(ACTIVE_STATUSES):
                gauge.add_metric([lane, status.value], counts.get((lane, status.value), 0))
        return gauge

    def _workers(self) -> Metric:
        gauge = GaugeMetricFamily("tidegate_workers", "Heartbeating workers by lane, pool and "
                                  "state", labels=["lane", "pool", "state"])
        counts: dict[tuple[str, str, str], int] = {}
        for lane in self.queue_owners():  # zeros too: alerts on `active == 0` need a series
            for pool in lane.pools:
                for state in WorkerState:
                    counts[lane.name, pool, state.value] = 0
        for hb in read_fleet(self.client, self.settings.namespace):
            key = (hb.lane, hb.pool, hb.state.value)
            counts[key] = counts.get(key, 0) + 1
        for labels, count in sorted(counts.items()):
            gauge.add_metric(list(labels), count)
        return gauge

    def _objectives(self) -> Metric:
        gauge = GaugeMetricFamily("tidegate_lane_ttft_p99_objective_seconds", "The lane's TTFT "
                                  "p99 objective (lanes file: ttft_p99_objective_ms)",
                                  labels=["lane"])
        for name, lane in sorted(self.settings.lanes.items()):
            gauge.add_metric([name], lane.ttft_p99_objective_ms / 1000)
        return gauge

    def _webhooks(self) -> Iterable[Metric]:
        count, oldest = self.webhooks.backlog()
        age_s = 0.0
        if oldest is not None:
            oldest = oldest if oldest.tzinfo else oldest.replace(tzinfo=UTC)  # SQLite: naive
            age_s = max(0.0, (datetime.now(UTC) - oldest).total_seconds())
        yield GaugeMetricFamily("tidegate_webhook_backlog", "Webhook deliveries waiting to be "
                                "sent (pending or sending)", value=count)
        yield GaugeMetricFamily("tidegate_webhook_oldest_pending_seconds", "Age of the oldest "
                                "undelivered webhook (0: none waits)", value=age_s)


def serve(settings: Settings, client: redis.Redis, store: Store) -> None:
    """Serves /metrics on metrics_host:scheduler_metrics_port (0: not at all); a taken port
    stops the scheduler at start, naming the setting."""
    port = settings.scheduler_metrics_port
    if not port:
        return
    REGISTRY.register(SchedulerCollector(settings, client, store))
    try:
        start_http_server(port, settings.metrics_host, registry=REGISTRY)
    except OSError as exc:
        raise SystemExit(f"tidegate scheduler: cannot serve /metrics on "
                         f"{settings.metrics_host}:{port} ({exc.strerror}); set "
                         "TIDEGATE_SCHEDULER_METRICS_PORT to a free port (0: off)") from None
    log.info("scheduler metrics on http://%s:%d/metrics", settings.metrics_host, port)
