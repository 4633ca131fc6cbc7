"""Reading worker heartbeats: the fleet as the API, the scheduler and `tidegate status`
see it."""

from __future__ import annotations

import json
from typing import Any

import redis

from tidegate import keys
from tidegate.records import Heartbeat


def read_fleet(client: redis.Redis, namespace: str) -> list[Heartbeat]:
    """Every worker heartbeating now, by name."""
    fleet = []
    for key in client.scan_iter(match=keys.worker_heartbeat_pattern(namespace), count=100):
        raw: Any = client.get(key)
        if raw:
            fleet.append(Heartbeat.from_json(raw))
    return sorted(fleet, key=lambda hb: hb.name)


def read_heartbeat(client: redis.Redis, namespace: str, name: str) -> Heartbeat | None:
    """The worker's last heartbeat; None once it has expired (the worker is gone)."""
    raw: Any = client.get(keys.worker_heartbeat(namespace, name))
    return Heartbeat.from_json(raw) if raw else None


def recent_actions(client: redis.Redis, namespace: str, count: int = 10) -> list[dict[str, Any]]:
    entries: Any = client.xrevrange(keys.scheduler_actions(namespace), count=count)
    return [json.loads(fields[b"a"]) for _, fields in reversed(entries)]
