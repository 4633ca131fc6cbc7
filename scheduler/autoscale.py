"""Pre-warming: each tick, per lane, forecast the next minutes from the arrivals sampled
into the store and the declared peak windows, plan the active workers the forecast needs
(scheduler/planner.py) one lead time ahead, and activate standby workers to match,
warming them with the lane's hot prefixes first.

With pre-warming off (`TIDEGATE_PREWARM=false`) this is reactive scaling only: each lane
is planned on the mean arrivals of the last 5 complete minutes, with no forecast, no
declared peak and no lead time.

New capacity is not the scheduler's to start: each tick it writes its plan per lane to
the plans stream (`keys.scheduler_plans`), with `short`, the workers it wants ready (for
the next 30 minutes' peak with pre-warming, for the last minute without) beyond those the
lane holds (active, standby and starting). A node autoscaler or an operator starts
workers (in standby) from it; bench/festival.py plays that part.

Times here are planning time (`settings.clock`): the real clock, or a replay's
compressed one (tidegate/clock.py); what is measured in real seconds (an activation, the
tick period) is converted to it.

Scale-down is left to an operator (`deactivate` drains a worker): handing workers back
right after a peak is cheap to get wrong and costs only standby capacity to skip.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import redis
from celery import Celery

from scheduler import control
from scheduler.forecast import MINUTE, forecast, minute_of, peak_rate_per_s
from scheduler.peaks import PeakWindow, peak_factor, windows_of
from scheduler.planner import Capacity, capacity_from, lead_time_s, plan
from store import Store
from tidegate import hot, keys
from tidegate.fleet import read_fleet
from tidegate.lanes import Lane
from tidegate.records import WorkerState
from tidegate.router import DEFAULT_JOB_MS, WorkerView
from tidegate.settings import Settings

HISTORY = timedelta(days=8)  # last week's same minute, plus the smoothing window
HORIZON_MIN = 30
DEFAULT_ACTIVATION_S = 15.0  # until activations have been measured here
HOT_PREFIXES = 5  # most used system prompts of recent traffic warmed on activation
# Reactive scaling plans on the mean of the last complete minutes: an autoscaler's
# averaging window, so one busy minute's noise does not start a worker.
REACTIVE_WINDOW_MIN = 5


def flush_arrivals(client: Any, store: Store, settings: Settings) -> int:
    """Moves the API's per-minute arrival counters of finished minutes into the store."""
    current = settings.clock.minute()
    moved = 0
    for key in client.scan_iter(match=keys.arrivals_pattern(settings.namespace), count=500):
        lane, minute = keys.parse_arrivals(key.decode())
        if minute >= current:
            continue
        count = client.getdel(key)
        if count:
            at = datetime.fromtimestamp(minute * 60, UTC)
            store.traffic.record_arrivals(lane, at, int(count))
            moved += int(count)
    return moved


def hot_prefixes(client: redis.Redis, settings: Settings, lane: str) -> list[str]:
    return hot.read(client, settings.namespace, lane, HOT_PREFIXES)


def activation_s(client: redis.Redis, settings: Settings) -> float:
    """A high percentile of measured activations: a late worker is what hurts."""
    raw = cast(list[bytes], client.lrange(keys.activation_times(settings.namespace), 0, -1))
    times = sorted(float(x) for x in raw)
    return times[int(0.9 * (len(times) - 1))] if times else DEFAULT_ACTIVATION_S


@dataclass(frozen=True)
class LanePlan:
    """One tick's plan for a lane."""

    want: int  # active workers for the traffic one lead time (and a tick) ahead
    ready: int  # workers to hold (active, standby, starting) for the horizon's peak
    # Rates in jobs per real second (a replay's arrivals per simulated second x speedup):
    rate: float  # what `want` is planned for: the forecast's peak, or the last minute's
    horizon_rate: float  # what `ready` is planned for
    now_rate: float  # expected in the current minute (reactive: the recent minutes' mean)


def lane_plan(store: Store, lane: Lane, views: list[WorkerView], now: datetime,
              lead_s: float, tick_s: float, prewarm: bool = True,
              speedup: float = 1.0) -> LanePlan:
    """The lane's plan at `now` (planning time); lead_s and tick_s in planning seconds.
    The plan's rates are jobs per real second, what the workers serve: arrivals per
    planning second times a replay clock's `speedup`."""
    cap = capacity_from(views, lane.name) or _standby_capacity(views, lane.name)

    def workers(rate: float) -> int:
        return plan(rate, cap.per_worker_rps, cap.mean_service_s, cap.slots,
                    lane.ttft_p99_objective_ms, lane.min_workers, lane.max_workers)

    per_s = speedup / 60.0  # arrivals per planning minute -> jobs per real second
    if not prewarm:  # reactive: what the last complete minutes brought
        until = minute_of(now)
        since = until - REACTIVE_WINDOW_MIN * MINUTE
        arrived = sum(n for _, n in store.traffic.arrivals(lane.name, since, until))
        rate = arrived / REACTIVE_WINDOW_MIN * per_s
        want = workers(rate)
        return LanePlan(want, want, rate, rate, rate)
    history = dict(store.traffic.arrivals(lane.name, now - HISTORY, now))
    windows = windows_of(lane)
    expected = forecast(history, now, HORIZON_MIN, windows)
    ahead = now + timedelta(seconds=lead_s + tick_s)
    rate = peak_rate_per_s(expected, now, ahead) * speedup
    horizon = peak_rate_per_s(expected, now, now + timedelta(minutes=HORIZON_MIN)) * speedup
    spare = lane.peak_spare_workers
    want = min(lane.max_workers, workers(rate) + (spare if in_peak(windows, now, ahead) else 0))
    in_horizon = in_peak(windows, now, now + timedelta(minutes=HORIZON_MIN))
    ready = max(want, min(lane.max_workers, workers(horizon) + (spare if in_horizon else 0)))
    return LanePlan(want, ready, rate, horizon, expected[0][1] * per_s)


def in_peak(windows: list[PeakWindow], start: datetime, end: datetime) -> bool:
    """Whether a declared window is in force at some minute from `start` to `end`."""
    minutes = int((end - start).total_seconds() // 60) + 1
    return any(peak_factor(windows, start + timedelta(minutes=i)) != 1.0
               for i in range(minutes + 1))


def _standby_capacity(views: list[WorkerView], lane: str) -> Capacity:
    slots = max((w.slots for w in views if lane in w.lanes), default=1)
    service_s = DEFAULT_JOB_MS / 1000.0
    return Capacity(per_worker_rps=slots / service_s, mean_service_s=service_s, slots=slots)


def autoscale(app: Celery, client: redis.Redis, store: Store, settings: Settings,
              now: datetime | None = None) -> list[dict[str, object]]:
    clock = settings.clock
    now = now or clock.now()
    heartbeats = read_fleet(client, settings.namespace)
    views = [WorkerView.from_heartbeat(hb) for hb in heartbeats]
    lead_s = lead_time_s(clock.sim_s(activation_s(client, settings)))
    tick_s = clock.sim_s(settings.scheduler_tick_s)
    actions = []
    for lane in settings.lanes.values():
        if lane.runs_on is not None:
            continue  # its jobs run on its host lane's workers, which that lane's plan keeps
        p = lane_plan(store, lane, views, now, lead_s, tick_s, settings.prewarm, clock.speedup)
        held = {state: [w for w in views if w.state == state and lane.name in w.lanes]
                for state in (WorkerState.ACTIVE, WorkerState.STANDBY, WorkerState.STARTING)}
        active, standby = held[WorkerState.ACTIVE], held[WorkerState.STANDBY]
        for worker in standby[:max(0, p.want - len(active))]:
            actions.append(_activate(app, client, settings, lane, worker, p.want, p.rate))
        record_plan(client, settings, lane, now, p, {s.value: len(ws) for s, ws in held.items()})
    return actions


def record_plan(client: redis.Redis, settings: Settings, lane: Lane, now: datetime, p: LanePlan,
                held: dict[str, int]) -> None:
    """The tick's plan for the lane, for a node autoscaler (`short`), `tidegate status`
    and the festival replay's report."""
    body = {"ts": time.time(), "at": now.timestamp(), "lane": lane.name,
            "prewarm": settings.prewarm, "forecast_rps": round(p.rate, 3),
            "horizon_rps": round(p.horizon_rate, 3), "now_rps": round(p.now_rate, 3),
            "want_active": p.want,
            "want_ready": p.ready, **held, "short": max(0, p.ready - sum(held.values()))}
    client.xadd(keys.scheduler_plans(settings.namespace), {"p": json.dumps(body)},
                maxlen=keys.PLANS_MAXLEN, approximate=True)


def _activate(app: Celery, client: redis.Redis, settings: Settings, lane: Lane, worker: WorkerView,
              want: int, rate: float) -> dict[str, object]:
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
