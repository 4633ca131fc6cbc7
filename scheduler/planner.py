"""Pre-warm planner: how many active workers a lane needs, and how far ahead to act.

Pure: the forecast rate and the workers' measured figures come in as values.

Queueing model. A lane's active workers pull from one queue; each worker runs `k`
sequences at once, so c workers are an M/M/n queue with n = c * k servers, each serving
at rate mu = 1 / mean_service_s. k is the concurrency a worker sustains by Little's law
on its measured capacity, k = capacity_rps * mean_service_s, at most its slots (a worker
whose throughput flattens before its slots fill counts for fewer servers).

With offered load a = lambda / mu, the Erlang C formula gives the probability that a job
waits, C(n, a), and the M/M/n wait tail is P(W > t) = C(n, a) * exp(-(n*mu - lambda) t).
The q-quantile of the wait is therefore 0 when C <= 1 - q, else
ln(C / (1 - q)) / (n*mu - lambda). TTFT = wait + prefill, so the wait's budget is the
lane's TTFT P99 objective minus the prefill time (which no number of workers shortens).

plan() returns the smallest c in [min_workers, max_workers] whose P99 wait keeps that
budget at the forecast rate raised by `headroom` (a cushion for forecast error and
Poisson bursts); max_workers when none does. Erlang B is computed with its stable
recurrence B(n) = a B(n-1) / (n + a B(n-1)), one pass for every c, and
C = n B / (n - a (1 - B)).

Lead time: a worker must be asked to activate the measured activation time (standby ->
active) plus a margin before the traffic it is for arrives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tidegate.records import WorkerState
from tidegate.router import DEFAULT_JOB_MS, WorkerView

P99 = 0.99


@dataclass(frozen=True)
class Capacity:
    """A lane's per-worker figures, as the workers' heartbeats report them."""

    per_worker_rps: float  # jobs a worker completes per second with its slots full
    mean_service_s: float  # a job's mean time on a worker, prefill included
    slots: int  # sequences a worker runs at once


def capacity_from(fleet: Sequence[WorkerView], lane: str) -> Capacity | None:
    """Mean figures of the lane's active workers; None when no active worker reports.

    A worker that has not finished a job yet is assumed at the router's default."""
    views = [w for w in fleet if w.state == WorkerState.ACTIVE and lane in w.lanes]
    if not views:
        return None
    service_s = sum((w.mean_job_ms or DEFAULT_JOB_MS) for w in views) / len(views) / 1000.0
    slots = round(sum(w.slots for w in views) / len(views))
    return Capacity(per_worker_rps=slots / service_s, mean_service_s=service_s, slots=slots)


def servers_per_worker(per_worker_capacity_rps: float, mean_service_s: float,
                       slots: int) -> int:
    """Concurrent sequences a worker sustains (Little's law), at most its slots."""
    sustained = math.floor(per_worker_capacity_rps * mean_service_s + 1e-9)
    return max(1, min(slots, sustained))


def wait_quantile_s(servers: int, offered: float, erlang_b: float, mean_service_s: float,
                    q: float = P99) -> float:
    """The q-quantile of the M/M/n wait, given Erlang B for (servers, offered)."""
    if offered >= servers:
        return math.inf  # the queue grows without bound
    p_wait = servers * erlang_b / (servers - offered * (1.0 - erlang_b))
    if p_wait <= 1.0 - q:
        return 0.0
    return math.log(p_wait / (1.0 - q)) * mean_service_s / (servers - offered)


def plan(forecast_peak_rate_per_s: float, per_worker_capacity_rps: float,
         mean_service_s: float, slots: int, ttft_objective_ms: float, min_workers: int,
         max_workers: int, headroom: float = 0.2, prefill_ms: float = 0.0) -> int:
    """Active workers the lane needs for the forecast peak rate; see the module docstring.

    prefill_ms: the part of TTFT spent in prefill, which more workers do not shorten.
    """
    if min_workers > max_workers:
        raise ValueError(f"min_workers {min_workers} > max_workers {max_workers}")
    offered = forecast_peak_rate_per_s * (1.0 + headroom) * mean_service_s
    if offered <= 0:
        return min_workers
    k = servers_per_worker(per_worker_capacity_rps, mean_service_s, slots)
    budget_s = max(0.0, ttft_objective_ms - prefill_ms) / 1000.0
    erlang_b = 1.0  # B(0); each worker adds k servers to the recurrence
    for workers in range(1, max_workers + 1):
        for n in range((workers - 1) * k + 1, workers * k + 1):
            erlang_b = offered * erlang_b / (n + offered * erlang_b)
        if workers < min_workers:
            continue
        if wait_quantile_s(workers * k, offered, erlang_b, mean_service_s) <= budget_s:
            return workers
    return max_workers


def lead_time_s(measured_activation_s: float, margin_s: float = 30.0) -> float:
    """How long before the traffic a worker must be asked to activate.

    measured_activation_s: the standby -> active time the workers report (take a high
    percentile of the measurements, not the mean: a late worker is what hurts)."""
    if measured_activation_s < 0 or margin_s < 0:
        raise ValueError("activation time and margin must be >= 0")
    return measured_activation_s + margin_s
