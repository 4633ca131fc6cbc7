"""Health: a worker whose cache allocation latency stays above its threshold gets the
cheap fix first (reset the prefix cache); if that does not help, a rolling restart:
drain, restart the engine, warm, reactivate. One worker at a time, and never when that
would leave its lane below its minimum of active workers.
"""

from __future__ import annotations

import json
import math
import time
from typing import cast

import redis
from celery import Celery

from scheduler import control
from tidegate import keys
from tidegate.fleet import read_fleet, read_heartbeat
from tidegate.locks import RedisLock, new_token
from tidegate.records import Heartbeat, WorkerState
from tidegate.settings import Settings

STRIKES_TO_ACT = 2  # consecutive checks over the threshold before acting


def check(app: Celery, client: redis.Redis, settings: Settings) -> list[dict[str, object]]:
    fleet = read_fleet(client, settings.namespace)
    actions: list[dict[str, object]] = []
    for hb in fleet:
        latency = hb.stats.avg_cache_allocation_latency_ms if hb.stats else None
        if hb.state != WorkerState.ACTIVE or latency is None:
            continue
        strikes_key = keys.health_strikes(settings.namespace, hb.name)
        if latency <= settings.alloc_latency_threshold_ms:
            client.delete(strikes_key)
            continue
        strikes = cast(int, client.hincrby(strikes_key, "strikes", 1))
        client.expire(strikes_key, keys.HEALTH_STRIKES_TTL_S)
        if strikes >= STRIKES_TO_ACT:
            actions.append(_act(app, client, settings, hb, fleet, latency))
    return actions


def _act(app: Celery, client: redis.Redis, settings: Settings, hb: Heartbeat,
         fleet: list[Heartbeat], latency: float) -> dict[str, object]:
    name = hb.name
    strikes_key = keys.health_strikes(settings.namespace, name)
    base = {"worker": name, "alloc_latency_ms": latency}
    if not client.hget(strikes_key, "reset"):
        client.hset(strikes_key, "reset", "1")
        app.control.broadcast("tidegate_reset_prefix_cache", destination=[name], reply=True,
                              timeout=control.CONTROL_TIMEOUT_S)
        return {**base, "action": "reset_prefix_cache"}
    lane = hb.lane
    others = [w for w in fleet if w.name != name and w.state == WorkerState.ACTIVE
              and lane in w.lanes]
    if len(others) < getattr(settings.lanes[lane], "min_workers", 1):
        return {**base, "action": "restart_deferred",
                "reason": f"lane {lane} would drop below its minimum of active workers"}
    lock = RedisLock(client, keys.scheduler_lock(settings.namespace, "restart", 0),
                     math.ceil(settings.restart_timeout_s), token=new_token(name))
    if not lock.acquire():
        return {**base, "action": "restart_deferred", "reason": "another restart is running"}
    try:
        return {**base, **rolling_restart(app, client, settings, hb)}
    finally:
        lock.release()
        client.delete(strikes_key)


def _wait_restarted(client: redis.Redis, settings: Settings, name: str, old_boot: str) -> bool:
    """Until the worker heartbeats from a new process with its engine loaded."""
    end = time.monotonic() + settings.restart_timeout_s
    while time.monotonic() < end:
        hb = read_heartbeat(client, settings.namespace, name)
        if hb is not None and hb.boot != old_boot and hb.state == WorkerState.STANDBY:
            return True
        time.sleep(0.5)
    return False


def rolling_restart(app: Celery, client: redis.Redis, settings: Settings,
                    hb: Heartbeat) -> dict[str, object]:
    name, lane, pool = hb.name, hb.lane, hb.pool
    drained = control.deactivate(app, client, settings, name, lane, pool)
    app.control.broadcast("tidegate_restart_engine", destination=[name], reply=True,
                          timeout=control.CONTROL_TIMEOUT_S)
    restarted = _wait_restarted(client, settings, name, hb.boot)
    warm = settings.lanes[lane].warm_prompts
    active = restarted and control.activate(app, client, settings, name, lane, pool,
                                            warm_prompts=warm)
    return {"action": "rolling_restart", "drained": drained, "restarted": restarted,
            "reactivated": active,
            "steps": json.dumps(["drain", "restart_engine", "warm", "activate"])}
