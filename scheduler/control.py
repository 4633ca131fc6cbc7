"""Steering workers through Celery control commands.

Celery's `add_consumer` answers before the change is applied and is forgotten when a
worker restarts, so every change here is verified and recorded as the desired state in
Redis; `reconcile` re-applies that record.

An activation is verified by the worker itself, once the queue is consumed: its command
(`tidegate_consume`, workers/control.py) writes a heartbeat whose `consuming` names
the queue and publishes its name on the fleet channel, which the scheduler waits on here
and the API's routers follow (api/fleet.py). One control round trip and one message, not
a poll of `inspect().active_queues()` nor a heartbeat period; `active_queues()` remains
the check when no such message comes (a worker without the command, a lost message).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import redis
from celery import Celery

from tidegate import keys
from tidegate.fleet import FleetEvents, read_fleet
from tidegate.lanes import pool_queue
from tidegate.records import WorkerState
from tidegate.settings import Settings

log = logging.getLogger("tidegate.scheduler")

CONTROL_TIMEOUT_S = 5.0
ANNOUNCE_WAIT_S = 2.0  # the worker's fleet message, before `active_queues()` is asked
VERIFY_POLL_S = 0.05  # between `active_queues()` checks


@dataclass(frozen=True)
class Desired:
    state: WorkerState  # active | standby
    queue: str  # the pool queue the worker consumes when active


def desired(client: redis.Redis, settings: Settings) -> dict[str, Desired]:
    raw = cast(dict[bytes, bytes], client.hgetall(keys.desired_states(settings.namespace)))
    return {k.decode(): _desired(json.loads(v)) for k, v in raw.items()}


def _desired(body: dict[str, str]) -> Desired:
    return Desired(state=WorkerState(body["state"]), queue=body["queue"])


def _record(client: redis.Redis, settings: Settings, worker: str, want: Desired) -> None:
    client.hset(keys.desired_states(settings.namespace), worker,
                json.dumps({"state": want.state, "queue": want.queue}))


def consumes(app: Celery, worker: str, queue: str) -> bool:
    replies = app.control.inspect(destination=[worker], timeout=CONTROL_TIMEOUT_S).active_queues()
    return any(q["name"] == queue for q in (replies or {}).get(worker, []))


def add_consumer(app: Celery, client: redis.Redis, settings: Settings, worker: str, queue: str,
                 verify_s: float = 10.0) -> bool:
    """Makes the worker consume `queue`; True once it is seen to. The control reply comes
    before the consumer is really added: the worker's fleet message says when it is (its
    heartbeat's `consuming`), else `active_queues()`, asked until `verify_s`."""
    end = time.monotonic() + verify_s
    with FleetEvents(client, settings.namespace) as events:  # subscribed before the command
        replies = app.control.broadcast("tidegate_consume", arguments={"queue": queue},
                                        destination=[worker], reply=True,
                                        timeout=CONTROL_TIMEOUT_S)
        if _answered_ok(replies, worker):
            hb = events.wait(worker, lambda hb: queue in hb.consuming,
                             min(ANNOUNCE_WAIT_S, verify_s))
            if hb is not None:
                return True
        else:  # a worker that lacks the command (an older version): Celery's own
            app.control.add_consumer(queue, destination=[worker], reply=True,
                                     timeout=CONTROL_TIMEOUT_S)
    while True:
        if consumes(app, worker, queue):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(VERIFY_POLL_S)


def _answered_ok(replies: list[dict[str, Any]] | None, worker: str) -> bool:
    return any(isinstance(r.get(worker), dict) and r[worker].get("ok") for r in replies or [])


def activate(app: Celery, client: redis.Redis, settings: Settings, worker: str, lane: str,
             pool: str, warm_prompts: list[str] | None = None,
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
    ok = add_consumer(app, client, settings, worker, queue)
    log.info("activate %s on %s: %s", worker, queue, "verified" if ok else "not confirmed")
    return ok


def deactivate(app: Celery, client: redis.Redis, settings: Settings, worker: str, lane: str,
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


def reconcile(app: Celery, client: redis.Redis, settings: Settings) -> list[str]:
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
            ok = add_consumer(app, client, settings, hb.name, want.queue)
            actions.append(f"re-activated {hb.name} on {want.queue}"
                           + ("" if ok else " (not confirmed yet)"))
        elif want.state == WorkerState.STANDBY and consuming:
            app.control.cancel_consumer(want.queue, destination=[hb.name], reply=True,
                                        timeout=CONTROL_TIMEOUT_S)
            actions.append(f"returned {hb.name} to standby")
    return actions
