"""Prometheus metrics of one API process: only what this process itself measured (jobs it
admitted, requests it refused, SSE streams it holds open), so that the replicas behind a
load balancer add up: `sum(rate(tidegate_jobs_admitted_total[5m]))` counts each job once.

Job timings and tokens are the workers' (workers/metrics.py), fleet-wide gauges (queue
depth, workers by state) the scheduler's (scheduler/metrics.py): each served by its own
process. docs/operations.md's "Metrics" table lists every metric and where it is served.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics

# `_created` series double every counter's series and no dashboard or alert reads them.
disable_created_metrics()


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.admitted = Counter("tidegate_jobs_admitted_total", "Jobs this API process "
                                "accepted (202)", ["lane"], registry=r)
        self.rejected = Counter("tidegate_requests_rejected_total", "Requests this API process "
                                "refused, by the error's type (invalid_request, unauthorized, "
                                "not_found, queue_full, too_many_in_flight, too_many_streams, "
                                "unavailable, ...) and HTTP status", ["reason", "status"],
                                registry=r)
        self.sse_streams = Gauge("tidegate_sse_streams", "SSE streams open in this API process",
                                 registry=r)

    def refused(self, reason: str, status: int) -> None:
        """One error answer (4xx, 503); labels are the error's type and status, never an id."""
        self.rejected.labels(reason, str(status)).inc()
