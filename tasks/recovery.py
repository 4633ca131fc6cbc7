"""Handing a dead worker's messages back to a live queue in seconds, not after the
broker's visibility timeout.

kombu's Redis transport keeps each message a worker took and has not acked in the
`unacked` hash (delivery tag -> [message, exchange, routing key]), its delivery time in
the `unacked_index` sorted set, and restores a message only once it is older than the
visibility timeout: minutes (celery-redis notes: 9-11 minutes after a SIGKILL). A live
attempt holds its job's lease, renewed every heartbeat (workers/lease.py). A message
taken more than `grace_s` ago whose job has no lease has no live consumer: it goes back
to its queue now, at its priority, by kombu's own `restore_by_tag`, and the next attempt
resumes after the tokens already streamed.

Back to its queue, unless that queue is a dead worker's direct queue (session affinity,
LoRA: tidegate.keys): a worker's default name holds its pid, so a restarted worker has a
new direct queue, and the old one is consumed by nobody. Such a message goes to a queue a
live worker of its lane consumes instead (`live_queue`: the lane's first pool with an
active worker), rewritten as if it had been sent there. The scheduler's reconciler moves
the messages still waiting in a dead worker's direct queue the same way
(scheduler/reconcile.py). Dead means no heartbeat: a heartbeat outlives
`keys.HEARTBEAT_PERIODS` missed beats.

The functions that read kombu's message format (task id, payload, priority, rerouting)
are here, beside the one that writes it (tasks/app.py `send_generate`).
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import time
from collections.abc import Callable, Collection
from typing import Any, cast

import redis
from celery import Celery
from kombu.transport.redis import QoS
from redis.client import Pipeline

from tasks.payloads import GENERATE
from tidegate import keys
from tidegate.fleet import read_fleet
from tidegate.lanes import pool_queue
from tidegate.records import Heartbeat, WorkerState
from tidegate.settings import Settings, get_settings

log = logging.getLogger("tidegate.recovery")


def restore_orphans(app: Celery, live_attempts: Callable[[list[str]], set[str]],
                    grace_s: float, settings: Settings | None = None) -> list[str]:
    """Restores every unacked message older than `grace_s` whose task (a job id) is not
    among `live_attempts(job ids)`; returns those job ids. It runs every heartbeat period
    over every long-running job: one round trip reads all the messages, one the leases."""
    settings = settings or get_settings()
    restored = []
    with app.pool.acquire(block=True) as conn:  # the app's pooled broker connections
        channel: Any = conn.default_channel
        qos, client = channel.qos, channel.client
        tags = client.zrangebyscore(qos.unacked_index_key, 0, time.time() - grace_s)
        raws = client.hmget(qos.unacked_key, tags) if tags else []
        entries = {tag: entry for tag, raw in zip(tags, raws, strict=True)
                   if raw and (entry := _unacked(raw)) is not None}
        jobs = {tag: job_id for tag, entry in entries.items()
                if (job_id := message_task_id(entry[0])) is not None}
        live = live_attempts(list(jobs.values())) if jobs else set()
        orphans = {tag: job_id for tag, job_id in jobs.items() if job_id not in live}
        fleet = read_fleet(client, settings.namespace) if orphans else []
        for tag, job_id in orphans.items():
            target = _reroute(settings, fleet, entries[tag])
            if target is None:
                qos.restore_by_tag(tag, client=client)
            else:
                _restore_to(client, qos, tag, target)
            restored.append(job_id)
    if restored:
        log.warning("restored %d message(s) of a dead worker: %s", len(restored),
                    ", ".join(restored))
    return restored


def _reroute(settings: Settings, fleet: list[Heartbeat], entry: list[Any]) -> str | None:
    """The queue to restore an unacked entry to, when its own is a dead worker's direct
    queue; None: its own queue (kombu's restore)."""
    message, _, routing_key = entry
    alive = {hb.name for hb in fleet}
    if stranded_worker(settings.namespace, str(routing_key), alive) is None:
        return None
    return target_queue(settings, fleet, message)


def _restore_to(client: redis.Redis, qos: QoS, tag: str, queue: str) -> None:
    """kombu's restore_by_tag, to `queue` instead of the message's own: one transaction
    that takes the entry out of the unacked hash and its index and pushes the message to
    the end of its priority's list that is served first, as a restore does."""

    def restore(pipe: Pipeline) -> None:
        raw = cast(bytes | None, pipe.hget(qos.unacked_key, tag))  # watched: read at once
        pipe.multi()
        pipe.zrem(qos.unacked_index_key, tag)
        pipe.hdel(qos.unacked_key, tag)
        entry = _unacked(raw) if raw else None
        if entry is not None:
            push_served_next(pipe, rerouted(entry[0], queue), queue)

    client.transaction(restore, qos.unacked_key)


# -- where a stranded message goes ---------------------------------------------------


def stranded_worker(ns: str, queue: str, alive: Collection[str]) -> str | None:
    """The dead worker whose direct queue `queue` is; None when it is not a direct queue
    or its worker heartbeats."""
    worker = keys.direct_queue_worker(ns, queue)
    return worker if worker is not None and worker not in alive else None


def target_queue(settings: Settings, fleet: list[Heartbeat],
                 message: dict[str, Any]) -> str | None:
    """Where a generate message from a dead worker's direct queue goes; None when it is
    no generate task of a known lane (it is left where it is)."""
    payload = message_payload(message)
    if payload is None:
        return None
    return live_queue(settings, fleet, str(payload.get("lane")), payload.get("lora"))


def live_queue(settings: Settings, fleet: list[Heartbeat], lane_name: str,
               lora: str | None = None) -> str | None:
    """A queue a live worker of the lane consumes: with a LoRA adapter, the direct queue
    of an active worker that has it; else the lane's first pool (in preference order)
    with an active worker; else its last pool, the flexible one, for the next worker that
    comes. None for an unknown lane."""
    lane = settings.lanes.get(lane_name)
    if lane is None:
        return None
    serving = [hb for hb in fleet if hb.state == WorkerState.ACTIVE and lane.name in hb.lanes]
    having = [hb for hb in serving if lora and lora in hb.lora]
    if having:
        return keys.direct_queue(settings.namespace, having[0].name)
    pools = [pool for pool in lane.pools if any(hb.pool == pool for hb in serving)]
    return pool_queue(lane, (pools or lane.pools[-1:])[0])


# -- kombu's message format ----------------------------------------------------------


def _unacked(raw: bytes | str) -> list[Any] | None:
    """An unacked hash entry: [message, exchange, routing key]; None if unreadable."""
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    ok = isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], dict)
    return entry if ok else None


def task_id(raw: bytes | str) -> str | None:
    """The Celery task id (tidegate's job id) of an unacked entry; None if unreadable."""
    entry = _unacked(raw)
    return message_task_id(entry[0]) if entry else None


def message_task_id(message: dict[str, Any]) -> str | None:
    """The Celery task id (tidegate's job id) of a message as kombu stores it."""
    try:
        return str(message["headers"]["id"])
    except (KeyError, TypeError):
        return None


def message_payload(message: dict[str, Any]) -> dict[str, Any] | None:
    """The GeneratePayload dict of a generate message (Celery's protocol 2 body:
    [args, kwargs, embed]); None for another task or an unreadable body."""
    try:
        if message["headers"]["task"] != GENERATE:
            return None
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return args[0] if isinstance(args[0], dict) else None
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def rerouted(message: dict[str, Any], queue: str) -> dict[str, Any]:
    """The message as if it had been sent to `queue` (the anonymous exchange routes by
    queue name, so a later restore of it goes to `queue`), marked redelivered."""
    message = copy.deepcopy(message)
    message.setdefault("headers", {})["redelivered"] = True
    info = message.setdefault("properties", {}).setdefault("delivery_info", {})
    info.update(exchange="", routing_key=queue, redelivered=True)
    return message


def push_served_next(pipe: Pipeline, message: dict[str, Any], queue: str) -> None:
    """Into `queue`'s list of the message's priority, at the end consumers take from
    (kombu's BRPOP; new messages go in at the other end): a message handed back has
    waited already."""
    pipe.rpush(keys.queue_sublists(queue)[message_priority(message)], json.dumps(message))


def message_priority(message: dict[str, Any]) -> int:
    """The message's Redis priority step, as kombu reads it (0 when unset)."""
    try:
        step = int(message["properties"]["priority"])
    except (KeyError, TypeError, ValueError):
        return 0
    return min(max(step, keys.PRIORITY_STEPS[0]), keys.PRIORITY_STEPS[-1])
