"""Reading worker heartbeats: the fleet as the API, the scheduler and `tidegate status`
see it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import redis

from tidegate import keys
from tidegate.records import Heartbeat

SCAN_COUNT = 1000  # keys a SCAN call walks (read_fleet)
SUBSCRIBE_WAIT_S = 5.0  # Redis confirms a SUBSCRIBE within this, or FleetEvents fails


def read_fleet(client: redis.Redis, namespace: str) -> list[Heartbeat]:
    """Every worker heartbeating now, by name.

    The SCAN walks the whole keyspace (every job's stream and lease among the heartbeats):
    a thousand keys a call, not Redis's default of ten, and the heartbeats found are read
    in one MGET, not a GET each. With 100 a call, the API's fleet reads (every 0.25 s)
    were 2.5% of its CPU at 256 streams (bench/README.md, "third round")."""
    found = list(client.scan_iter(match=keys.worker_heartbeat_pattern(namespace),
                                  count=SCAN_COUNT))
    raws: Any = client.mget(found) if found else []
    fleet = [Heartbeat.from_json(raw) for raw in raws if raw]  # None: expired since
    return sorted(fleet, key=lambda hb: hb.name)


def read_heartbeat(client: redis.Redis, namespace: str, name: str) -> Heartbeat | None:
    """The worker's last heartbeat; None once it has expired (the worker is gone)."""
    raw: Any = client.get(keys.worker_heartbeat(namespace, name))
    return Heartbeat.from_json(raw) if raw else None


def recent_actions(client: redis.Redis, namespace: str, count: int = 10) -> list[dict[str, Any]]:
    entries: Any = client.xrevrange(keys.scheduler_actions(namespace), count=count)
    return [json.loads(fields[b"a"]) for _, fields in reversed(entries)]


class FleetEvents:
    """The fleet channel (keys.fleet_channel), subscribed for a `with` block: a worker's
    name each time it wrote a heartbeat off its period (an activation). Subscribe before
    asking for the change, so that its message cannot be missed."""

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self.client, self.namespace = client, namespace
        self.pubsub = client.pubsub()  # type: ignore[no-untyped-call]

    def __enter__(self) -> FleetEvents:
        self.pubsub.subscribe(keys.fleet_channel(self.namespace))
        end = time.monotonic() + SUBSCRIBE_WAIT_S
        while time.monotonic() < end:  # subscribed once Redis says so, not when sent
            message = self.pubsub.get_message(timeout=max(0.0, end - time.monotonic()))
            if message is not None and message["type"] == "subscribe":
                return self
        self.pubsub.close()
        raise redis.TimeoutError("the fleet channel's SUBSCRIBE was not confirmed")

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.pubsub.close()

    def wait(self, worker: str, check: Callable[[Heartbeat], bool],
             timeout_s: float) -> Heartbeat | None:
        """The worker's heartbeat once it announced one that passes `check`; None when none
        did within `timeout_s`."""
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            message = self.pubsub.get_message(timeout=left)
            if message is None or message["type"] != "message":
                continue
            if message["data"] == worker.encode():
                hb = read_heartbeat(self.client, self.namespace, worker)
                if hb is not None and check(hb):
                    return hb
        return None
