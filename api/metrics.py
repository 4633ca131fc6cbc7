"""Prometheus metrics of the API: queue wait, TTFT, TPOT and end-to-end time by lane, and
each worker's engine (KV cache use, prefix cache hit rate, cache allocation latency).

Workers append a summary of every finished job to one Redis stream; the API follows it
and observes the histograms, so `/metrics` covers jobs whichever worker ran them. Engine
gauges come from the workers' heartbeats, read when Prometheus scrapes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tidegate import keys
from tidegate.records import Heartbeat

log = logging.getLogger("tidegate.api")

_MS_BUCKETS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_wait = Histogram("tidegate_queue_wait_ms", "Time from enqueue to a worker "
                                    "starting the job", ["lane"], buckets=_MS_BUCKETS, registry=r)
        self.ttft = Histogram("tidegate_ttft_ms",
                              "Time from a worker starting the job to its first token", ["lane"],
                              buckets=_MS_BUCKETS, registry=r)
        self.tpot = Histogram("tidegate_tpot_ms", "Time per output token after the first",
                              ["lane"], buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
                              registry=r)
        self.e2e = Histogram("tidegate_e2e_ms", "Time from enqueue to the job's end", ["lane"],
                             buckets=_MS_BUCKETS, registry=r)
        self.jobs = Counter("tidegate_jobs_total", "Jobs accepted by the API", ["lane"],
                            registry=r)
        self.finished = Counter("tidegate_jobs_finished_total", "Jobs finished, by status",
                                ["lane", "status"], registry=r)
        self.rejected = Counter("tidegate_requests_rejected_total", "Requests refused, by field",
                                ["field"], registry=r)
        self.shed = Counter("tidegate_requests_shed_total", "Requests refused for load or an "
                            "outage (429 and 503), by the error's type: queue_full, "
                            "too_many_in_flight, too_many_streams, overloaded, ...", ["reason"],
                            registry=r)
        self.sse_streams = Gauge("tidegate_sse_streams", "SSE streams open in this API process",
                                 registry=r)

    def observe(self, s: dict[str, object]) -> None:
        lane = str(s.get("lane", ""))
        self.finished.labels(lane, str(s.get("status", ""))).inc()
        for hist, name in ((self.queue_wait, "queue_wait_ms"), (self.ttft, "ttft_ms"),
                           (self.tpot, "tpot_ms"), (self.e2e, "e2e_ms")):
            value = s.get(name)
            if isinstance(value, int | float):
                hist.labels(lane).observe(float(value))

    async def follow(self, client: aioredis.Redis, namespace: str) -> None:
        """Observe every job that finishes from now on (runs until cancelled)."""
        stream, last = keys.finished_stream(namespace), "$"
        while True:
            try:
                reply: Any = await client.xread({stream: last}, block=5000, count=500)
            except aioredis.RedisError as exc:
                log.warning("metrics follower lost Redis: %s", exc)
                await asyncio.sleep(1)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    self.observe(json.loads(fields[b"s"]))


# name, help, heartbeat stats field; labelled by worker, lane, engine and KV policy
_ENGINE_GAUGES = (
    ("tidegate_worker_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache "
     "over prompt tokens, as vLLM counts them, since the engine started", "prefix_hit_rate"),
    ("tidegate_worker_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix "
     "cache since the engine started", "prefix_queries_tokens"),
    ("tidegate_worker_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache "
     "since the engine started", "prefix_hits_tokens"),
    ("tidegate_worker_cache_allocation_latency_ms", "Time per scheduler step spent "
     "allocating KV cache, recent average", "avg_cache_allocation_latency_ms"),
    ("tidegate_worker_kv_cache_usage", "Fraction of KV cache blocks in use", "kv_usage"),
    ("tidegate_worker_kv_evictions", "Cached KV blocks reused for new contents since the "
     "engine started", "kv_evictions"),
)


class FleetCollector(Collector):
    """Engine gauges of every heartbeating worker, read at scrape time."""

    def __init__(self, read: Callable[[], list[Heartbeat]]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:
        fleet = self.read()
        for name, doc, field in _ENGINE_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["worker", "lane", "engine", "kv_policy"])
            for hb in fleet:
                value = getattr(hb.stats, field, None)
                if hb.stats is not None and isinstance(value, int | float):
                    gauge.add_metric([hb.name, ",".join(hb.lanes), hb.engine,
                                      hb.stats.kv_policy], float(value))
            yield gauge
