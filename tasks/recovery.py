"""Handing a dead worker's messages back to their queues in seconds, not after the
broker's visibility timeout.

kombu's Redis transport keeps each message a worker took and has not acked in the
`unacked` hash (delivery tag -> [message, exchange, routing key]), its delivery time in
the `unacked_index` sorted set, and restores a message only once it is older than the
visibility timeout: minutes (celery-redis notes: 9-11 minutes after a SIGKILL). A live
attempt holds its job's lease, renewed every heartbeat (workers/lease.py). A message
taken more than `grace_s` ago whose job has no lease has no live consumer: it goes back
to its queue now, at its priority, by kombu's own `restore_by_tag`, and the next attempt
resumes after the tokens already streamed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

log = logging.getLogger("tidegate.recovery")


def restore_orphans(app: Celery, live_attempts: Callable[[list[str]], set[str]],
                    grace_s: float) -> list[str]:
    """Restores every unacked message older than `grace_s` whose task (a job id) is not
    among `live_attempts(job ids)`; returns those job ids. It runs every heartbeat period
    over every long-running job: one round trip reads all the messages, one the leases."""
    restored = []
    with app.pool.acquire(block=True) as conn:  # the app's pooled broker connections
        channel: Any = conn.default_channel
        qos, client = channel.qos, channel.client
        tags = client.zrangebyscore(qos.unacked_index_key, 0, time.time() - grace_s)
        raws = client.hmget(qos.unacked_key, tags) if tags else []
        jobs = {tag: job_id for tag, raw in zip(tags, raws, strict=True)
                if raw and (job_id := task_id(raw)) is not None}
        live = live_attempts(list(jobs.values())) if jobs else set()
        for tag, job_id in jobs.items():
            if job_id not in live:
                qos.restore_by_tag(tag, client=client)
                restored.append(job_id)
    if restored:
        log.warning("restored %d message(s) of a dead worker: %s", len(restored),
                    ", ".join(restored))
    return restored


def task_id(raw: bytes | str) -> str | None:
    """The Celery task id (tidegate's job id) of an unacked entry; None if unreadable."""
    try:
        message = json.loads(raw)[0]
        return str(message["headers"]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None

