"""Steering workers through Celery control commands.

Celery's `add_consumer` answers before the change is applied and is forgotten when a
worker restarts, so every change here is verified with `inspect().active_queues()` and
recorded as the desired state in Redis; `reconcile` re-applies that record.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from celery import Celery

from tidegate import keys
from tidegate.fleet import read_fleet
from tidegate.lanes import pool_queue
from tidegate.records import WorkerState
from tidegate.settings import Settings

log = logging.getLogger("tidegate.scheduler")

CONTROL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Desired:
    state: WorkerState  # active | standby
    queue: str  # the pool queue the worker consumes when active


def desired(client: Any, settings: Settings) -> dict[str, Desired]:
    raw = client.hgetall(keys.desired_states(settings.namespace))
    return {k.decode(): _desired(json.loads(v)) for k, v in raw.items()}


def _desired(body: dict[str, str]) -> Desired:
    return Desired(state=WorkerState(body["state"]), queue=body["queue"])


def _record(client: Any, settings: Settings, worker: str, want: Desired) -> None:
    client.hset(keys.desired_states(settings.namespace), worker,
                json.dumps({"state": want.state, "queue": want.queue}))


def consumes(app: Celery, worker: str, queue: str) -> bool:
    replies = app.control.inspect(destination=[worker], timeout=CONTROL_TIMEOUT_S).active_queues()
    return any(q["name"] == queue for q in (replies or {}).get(worker, []))


def add_consumer(app: Celery, worker: str, queue: str, verify_s: float = 10.0) -> bool:
    """`add_consumer`, then `active_queues()` until the worker shows the queue: the
    control reply comes before the consumer is really added."""
    app.control.add_consumer(queue, destination=[worker], reply=True, timeout=CONTROL_TIMEOUT_S)
    end = time.monotonic() + verify_s
    while time.monotonic() < end:
        if consumes(app, worker, queue):
            return True
        time.sleep(0.2)
    return False


def activate(app: Celery, client: Any, settings: Settings, worker: str, lane: str, pool: str,
             warm_prompts: list[str] | None = None,
             warm_prefixes: list[str] | None = None) -> bool:
    """Warms the worker's cache with the lane's hot prefixes, then makes it consume its
    pool queue; True once `active_queues()` shows it.

    warm_prompts: system prompts, rendered by the worker with its model's chat template;
    warm_prefixes: prompt prefixes already rendered (recorded from traffic by the API).
    """
    queue = pool_queue(settings.lanes[lane], pool)
    _record(client, settings, worker, Desired(WorkerState.ACTIVE, queue))
    if warm_prompts or warm_prefixes:
        app.control.broadcast("tidegate_warm", arguments={
            "prompts": list(warm_prefixes or []), "system_prompts": list(warm_prompts or [])},
            destination=[worker], reply=True, timeout=120)
    ok = add_consumer(app, worker, queue)
    log.info("activate %s on %s: %s", worker, queue, "verified" if ok else "not confirmed")
    return ok


def deactivate(app: Celery, client: Any, settings: Settings, worker: str, lane: str,
               pool: str, drain_timeout_s: float = 300.0) -> bool:
    """Stops the worker consuming its pool queue, then waits until its in-flight jobs are
    finished; True when it drained in time."""
    queue = pool_queue(settings.lanes[lane], pool)
    _record(client, settings, worker, Desired(WorkerState.STANDBY, queue))
    app.control.cancel_consumer(queue, destination=[worker], reply=True,
                                timeout=CONTROL_TIMEOUT_S)
    end = time.monotonic() + drain_timeout_s
    while time.monotonic() < end:
        if not consumes(app, worker, queue) and in_flight(app, worker) == 0:
            return True
        time.sleep(0.2)
    return False


def in_flight(app: Celery, worker: str) -> int:
    replies = app.control.broadcast("tidegate_stats", reply=True, destination=[worker],
                                    timeout=CONTROL_TIMEOUT_S)
    for reply in replies or []:
        if worker in reply:
            return int(reply[worker].get("in_flight", 0))
    raise RuntimeError(f"worker {worker} did not answer tidegate_stats")


def reconcile(app: Celery, client: Any, settings: Settings) -> list[str]:
    """Re-applies the desired states: a restarted worker comes back consuming only its
    direct queue, whatever it was told before."""
    wanted, actions = desired(client, settings), []
    for hb in read_fleet(client, settings.namespace):
        want = wanted.get(hb.name)
        # A failed worker (dead engine) is on its way out: never hand it a queue again.
        if want is None or hb.state in (WorkerState.STARTING, WorkerState.RESTARTING,
                                        WorkerState.FAILED):
            continue
        consuming = want.queue in hb.consuming
        if want.state == WorkerState.ACTIVE and not consuming:
            ok = add_consumer(app, hb.name, want.queue)
            actions.append(f"re-activated {hb.name} on {want.queue}"
                           + ("" if ok else " (not confirmed yet)"))
        elif want.state == WorkerState.STANDBY and consuming:
            app.control.cancel_consumer(want.queue, destination=[hb.name], reply=True,
                                        timeout=CONTROL_TIMEOUT_S)
            actions.append(f"returned {hb.name} to standby")
    return actions
