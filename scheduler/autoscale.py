"""Pre-warming: each tick, per lane, forecast the next minutes from the arrivals sampled
into the store and the declared peak windows, plan the active workers the forecast needs
(scheduler/planner.py) one lead time ahead, and activate standby workers to match,
warming them with the lane's hot prefixes first.

Scale-down is left to an operator (`deactivate` drains a worker): handing workers back
right after a peak is cheap to get wrong and costs only standby capacity to skip.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery

from scheduler import control
from scheduler.forecast import forecast, peak_rate_per_s
from scheduler.peaks import windows_of
from scheduler.planner import Capacity, capacity_from, lead_time_s, plan
from scheduler.router import DEFAULT_JOB_MS, WorkerView
from store import Store
from tidegate import hot, keys
from tidegate.fleet import read_fleet
from tidegate.lanes import Lane
from tidegate.settings import Settings

HISTORY = timedelta(days=8)  # last week's same minute, plus the smoothing window
HORIZON_MIN = 30
DEFAULT_ACTIVATION_S = 15.0  # until activations have been measured here
HOT_PREFIXES = 5  # most used system prompts of recent traffic warmed on activation


def flush_arrivals(client: Any, store: Store, settings: Settings) -> int:
    """Moves the API's per-minute arrival counters of finished minutes into the store."""
    current = int(time.time() // 60)
    moved = 0
    for key in client.scan_iter(match=keys.arrivals_pattern(settings.namespace), count=500):
        lane, minute = keys.parse_arrivals(key.decode())
        if minute >= current:
            continue
        count = client.getdel(key)
        if count:
            store.record_arrivals(lane, datetime.fromtimestamp(minute * 60, UTC), int(count))
            moved += int(count)
    return moved


def hot_prefixes(client: Any, settings: Settings, lane: str) -> list[str]:
    return hot.read(client, settings.namespace, lane, HOT_PREFIXES)


def activation_s(client: Any, settings: Settings) -> float:
    """A high percentile of measured activations: a late worker is what hurts."""
    raw = client.lrange(keys.activation_times(settings.namespace), 0, -1)
    times = sorted(float(x) for x in raw)
    return times[int(0.9 * (len(times) - 1))] if times else DEFAULT_ACTIVATION_S


def lane_plan(store: Store, lane: Lane, views: list[WorkerView], now: datetime,
              lead_s: float, tick_s: float) -> tuple[int, float]:
    history = dict(store.arrivals(lane.name, now - HISTORY, now))
    expected = forecast(history, now, HORIZON_MIN, windows_of(lane))
    rate = peak_rate_per_s(expected, now, now + timedelta(seconds=lead_s + tick_s))
    cap = capacity_from(views, lane.name) or _standby_capacity(views, lane.name)
    want = plan(rate, cap.per_worker_rps, cap.mean_service_s, cap.slots,
                lane.ttft_p99_objective_ms, lane.min_workers, lane.max_workers)
    return want, rate


def _standby_capacity(views: list[WorkerView], lane: str) -> Capacity:
    slots = max((w.slots for w in views if lane in w.lanes), default=1)
    service_s = DEFAULT_JOB_MS / 1000.0
    return Capacity(per_worker_rps=slots / service_s, mean_service_s=service_s, slots=slots)


def autoscale(app: Celery, client: Any, store: Store, settings: Settings,
              now: datetime | None = None) -> list[dict[str, Any]]:
    now = now or datetime.now(UTC)
    heartbeats = read_fleet(client, settings.namespace)
    views = [WorkerView.from_heartbeat(hb) for hb in heartbeats]
    lead_s = lead_time_s(activation_s(client, settings))
    actions = []
    for lane in settings.lanes.values():
        if lane.runs_on is not None:
            continue  # its jobs run on its host lane's workers, which that lane's plan keeps
        want, rate = lane_plan(store, lane, views, now, lead_s, settings.scheduler_tick_s)
        active = [w for w in views if w.state == "active" and lane.name in w.lanes]
        standby = [w for w in views if w.state == "standby" and lane.name in w.lanes]
        for worker in standby[:max(0, want - len(active))]:
            actions.append(_activate(app, client, settings, lane, worker, want, rate))
    return actions


def _activate(app: Celery, client: Any, settings: Settings, lane: Lane, worker: WorkerView,
              want: int, rate: float) -> dict[str, Any]:
    started = time.monotonic()
    ok = control.activate(app, client, settings, worker.name, lane.name, worker.pool,
                          warm_prompts=lane.warm_prompts,
                          warm_prefixes=hot_prefixes(client, settings, lane.name))
    took_s = time.monotonic() - started
    client.lpush(keys.activation_times(settings.namespace), f"{took_s:.3f}")
    client.ltrim(keys.activation_times(settings.namespace), 0, 19)
    return {"action": "activate", "worker": worker.name, "lane": lane.name,
            "verified": ok, "want_active": want, "forecast_rps": round(rate, 3),
            "took_s": round(took_s, 2), "detail": json.dumps({"pool": worker.pool})}
