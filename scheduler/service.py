"""The scheduler process: Celery beat plus the periodic tasks it drives.

`tidegate scheduler` runs a small Celery worker with an embedded beat, consuming only the
scheduler's own queue. The beat is celery-redbeat's (scheduler/beat.py): its schedule and a
lock live in Redis, so of several replicas one beat sends the ticks and none writes a
schedule file. Each periodic task also takes a Redis lock for its period first, so a tick
sent twice (a beat taking over from one that stalled) acts once. Two periodic
tasks: the tick (traffic, desired states, pre-warm, health) every `scheduler_tick_s`, and
the reconciler (scheduler/reconcile.py: Redis made to agree with the store) every
`reconcile_s`, on a thread of its own so a long tick (a rolling restart) never holds it.
A third, the retention purge (scheduler/retention.py), runs every `retention_purge_s`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping

import redis
from celery import Celery

from scheduler import autoscale, control, health, metrics, reconcile, retention
from scheduler.beat import beat_config
from store import Store
from tasks.app import make_app, run_celery
from tidegate import keys, locks, redisconn
from tidegate.logs import setup_logging
from tidegate.settings import Settings, get_settings

log = logging.getLogger("tidegate.scheduler")

TICK = "tidegate.scheduler.tick"
RECONCILE = "tidegate.scheduler.reconcile"
PURGE = "tidegate.scheduler.purge"


def scheduler_queue(settings: Settings) -> str:
    return f"{settings.namespace}.scheduler"


def take_period(client: redis.Redis, namespace: str, name: str, period_s: float) -> int | None:
    """The current period's number if this process is the one to act in it, else None."""
    period = int(time.time() // period_s)
    if locks.take_period(client, keys.scheduler_lock(namespace, name, period), period_s):
        return period
    return None


def record_action(client: redis.Redis, namespace: str,
                  action: Mapping[str, object]) -> None:
    """Every action the scheduler takes, for `tidegate status`, Flower and the tests."""
    body = {"ts": time.time(), **action}
    log.info("scheduler action: %s", json.dumps(body))
    client.xadd(keys.scheduler_actions(namespace), {"a": json.dumps(body)},
                maxlen=keys.ACTIONS_MAXLEN, approximate=True)


def tick(app: Celery, client: redis.Redis, store: Store, settings: Settings) -> dict[str, object]:
    """One scheduler period: sample traffic, re-apply desired states, pre-warm ahead of
    the forecast, watch health. The returned actions show in Flower as the task result."""
    period = take_period(client, settings.namespace, "tick", settings.scheduler_tick_s)
    if period is None:  # another beat's tick holds this period
        client.incr(keys.scheduler_lock(settings.namespace, "skipped", 0))
        return {"acted": False}
    record_action(client, settings.namespace, {"action": "tick", "period": period})
    actions: list[dict[str, object]] = []
    arrivals = autoscale.flush_arrivals(client, store, settings)
    actions += [{"action": "reconcile", "detail": note}
                for note in control.reconcile(app, client, settings)]
    actions += autoscale.autoscale(app, client, store, settings)
    actions += health.check(app, client, settings)
    for action in actions:
        record_action(client, settings.namespace, action)
    return {"acted": True, "period": period, "arrivals_sampled": arrivals, "actions": actions}


def reconcile_pass(app: Celery, client: redis.Redis, store: Store,
                   settings: Settings) -> Mapping[str, object]:
    """One reconciler pass per period, by one scheduler; its actions are recorded."""
    if take_period(client, settings.namespace, "reconcile", settings.reconcile_s) is None:
        return {"acted": False}
    result = reconcile.reconcile(app, client, store, settings)
    for action in result.get("actions", []):
        record_action(client, settings.namespace, action)
        metrics.count_recovery(action)
    return dict(result)


def purge_pass(client: redis.Redis, store: Store, settings: Settings) -> dict[str, object]:
    """One retention purge per period, by one scheduler; what it removed is recorded."""
    if take_period(client, settings.namespace, "purge", settings.retention_purge_s) is None:
        return {"acted": False}
    removed = retention.purge(store, settings)
    record_action(client, settings.namespace, {"action": "purge", **removed})
    return {"acted": True, **removed}


def make_scheduler_app(settings: Settings) -> Celery:
    app = make_app(settings)
    app.conf.update(beat_config(settings))
    app.conf.beat_schedule = {
        "tick": {"task": TICK, "schedule": settings.scheduler_tick_s,
                 "options": {"queue": scheduler_queue(settings)}},
        # A pass that waited longer than a few periods is dropped: the next one comes.
        "reconcile": {"task": RECONCILE, "schedule": settings.reconcile_s,
                      "options": {"queue": scheduler_queue(settings),
                                  "expires": max(5 * settings.reconcile_s, 10.0)}},
        "purge": {"task": PURGE, "schedule": settings.retention_purge_s,
                  "options": {"queue": scheduler_queue(settings),
                              "expires": settings.retention_purge_s}},
    }
    client = redisconn.sync_client(settings.redis_url, **settings.redis_timeouts)
    store = Store(settings.db_url, **settings.store_timeouts)

    @app.task(name=TICK, ignore_result=True, acks_late=False)
    def _tick() -> dict[str, object]:
        return tick(app, client, store, settings)

    @app.task(name=RECONCILE, ignore_result=True, acks_late=False)
    def _reconcile() -> Mapping[str, object]:
        return reconcile_pass(app, client, store, settings)

    @app.task(name=PURGE, ignore_result=True, acks_late=False)
    def _purge() -> dict[str, object]:
        return purge_pass(client, store, settings)

    return app


def run_scheduler(loglevel: str = "INFO") -> None:
    settings = get_settings()
    setup_logging(settings, "scheduler")
    metrics.serve(settings, redisconn.sync_client(settings.redis_url, **settings.redis_timeouts),
                  Store(settings.db_url, **settings.store_timeouts))
    app = make_scheduler_app(settings)
    # Threads: a tick, a reconciler pass, a purge, and one spare for a tick that runs long.
    run_celery(app, ["worker", "-B", "-P", "threads", "-c", "4", "-Q",
                     scheduler_queue(settings), "-n", f"scheduler-{int(time.time())}@%h",
                     "--loglevel", loglevel, "--without-gossip", "--without-mingle"])
