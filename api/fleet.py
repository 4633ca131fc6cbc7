"""The fleet as the API sees it: the routers' cached view of the heartbeats (FleetCache),
refreshed at once when a worker announces a change, and `GET /fleetz`'s report of each
lane's workers by state and pool.

Kept apart from /readyz on purpose. /readyz says whether this API process can serve
(Redis, the database, its tokenizer), and a load balancer acts on it; whether workers are
active is the fleet's health, not the API's: during a rolling worker restart every API
pod would otherwise leave the load balancer, and submits would fail instead of queueing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.jsontypes import JSONObject
from tidegate.lanes import Lane
from tidegate.records import Heartbeat, WorkerState
from tidegate.router import WorkerView

log = logging.getLogger("tidegate.api")

FLEET_CACHE_S = 0.25  # heartbeats are read again after this long (fleet_cache_s's default)
FOLLOW_POLL_S = 1.0  # follow_fleet waits this long for a message per call


def fleet_report(fleet: Iterable[Heartbeat], lanes: Mapping[str, Lane]) -> JSONObject:
    """{"ready", "workers": {state: count}, "lanes": {lane: {"ready", "runs_on"?,
    state: {pool: [names]}}}}. A lane is ready when a worker serving it is active, or
    when it needs none (`min_workers = 0`); the fleet is ready when every lane is. A lane
    that runs on another's workers (`runs_on`) reports that lane's workers, and any worker
    started on the lane itself (the demo starts one per lane)."""
    workers = list(fleet)
    report = {name: _lane_report(lane, lanes, workers) for name, lane in sorted(lanes.items())}
    counts = {state.value: sum(hb.state == state for hb in workers) for state in WorkerState}
    return {"ready": all(r["ready"] for r in report.values()), "workers": counts,
            "lanes": report}


def _lane_report(lane: Lane, lanes: Mapping[str, Lane], fleet: list[Heartbeat]) -> JSONObject:
    host = lanes.get(lane.runs_on, lane) if lane.runs_on else lane
    by_state: dict[str, dict[str, list[str]]] = {state.value: {} for state in WorkerState}
    for hb in fleet:
        if host.name in hb.lanes or lane.name in hb.lanes:
            by_state[hb.state.value].setdefault(hb.pool, []).append(hb.name)
    for pools in by_state.values():
        for names in pools.values():
            names.sort()
    ready = bool(by_state[WorkerState.ACTIVE.value]) or host.min_workers == 0
    return {"ready": ready, **({"runs_on": host.name} if lane.runs_on else {}), **by_state}


def active_workers(report: Mapping[str, Any]) -> set[str]:
    """Every worker the report shows active, whatever its lane and pool."""
    return {name for lane in report["lanes"].values()
            for names in lane[WorkerState.ACTIVE.value].values() for name in names}


class FleetCache:
    """Worker heartbeats as router views, read at most every `max_age_s` (a SCAN per
    submit was a large share of the API's time) and again at once after a worker announced
    a change (`changed`, from follow_fleet): a submit right after an activation is routed
    to the activated worker, not refused until the cache and the next beat catch up."""

    def __init__(self, read: Callable[[], list[Heartbeat]], max_age_s: float = FLEET_CACHE_S):
        self._read, self.max_age_s = read, max_age_s
        self._lock = threading.Lock()  # one read at a time; the others wait for its views
        self._views: list[WorkerView] = []
        self._read_at = -float("inf")
        # Bumped by each announcement. A read records the generation it started in, so a
        # read that began before an announcement does not count as after it.
        self._generation = 0
        self._read_generation = -1

    def views(self) -> list[WorkerView]:
        with self._lock:
            fresh = time.monotonic() - self._read_at <= self.max_age_s
            if fresh and self._read_generation == self._generation:
                return self._views
            generation = self._generation
            self._views = [WorkerView.from_heartbeat(hb) for hb in self._read()]
            self._read_at, self._read_generation = time.monotonic(), generation
            return self._views

    def changed(self) -> None:
        """The next `views` reads the heartbeats again. No lock: it must not wait for a
        read in progress, and only follow_fleet's one task writes the counter."""
        self._generation += 1


class LentSlots:
    """The borrowed jobs this process sent to each worker (tidegate/router.py, step 4)
    that the worker's last beat may not show yet. A beat is up to `heartbeat_s` old: without
    this count one idle slot would draw every borrower of a burst. A send is forgotten once
    a beat `margin_s` younger than it came (the beat then counts the job, running or
    waiting). Each API process counts its own sends, so N processes may lend one slot N
    times within a beat; the extra borrowers wait in the lender's engine, behind its own
    lane's jobs, never ahead of them."""

    def __init__(self, margin_s: float = 0.5, clock: Callable[[], float] = time.time) -> None:
        self._margin_s, self._clock = margin_s, clock
        self._lock = threading.Lock()
        self._sent: dict[str, list[float]] = {}

    def sent(self, worker: str) -> None:
        with self._lock:
            self._sent.setdefault(worker, []).append(self._clock())

    def since_beats(self, fleet: Iterable[WorkerView]) -> dict[str, int]:
        """Per worker: borrowed jobs sent after its last beat (less the margin)."""
        counts = {}
        with self._lock:
            for view in fleet:
                times = self._sent.get(view.name)
                if not times:
                    continue
                kept = [t for t in times if t >= view.beat_ts - self._margin_s]
                self._sent[view.name] = kept
                counts[view.name] = len(kept)
        return counts


async def follow_fleet(client: aioredis.Redis, namespace: str,
                       on_change: Callable[[], None]) -> None:
    """Calls `on_change` whenever a worker announces a change on the fleet channel
    (keys.fleet_channel), and after each (re)subscribe for what was missed meanwhile; runs
    until cancelled. A lost message costs at most `fleet_cache_s` of a stale fleet."""
    while True:
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(keys.fleet_channel(namespace))
                on_change()
                while True:
                    # get_message's own timeout, not listen(): the client's socket timeout
                    # would end an idle listen with TimeoutError (as in api/auth.py).
                    message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                       timeout=FOLLOW_POLL_S)
                    if message is not None and message.get("type") == "message":
                        on_change()
        except Exception as exc:  # Redis went away: subscribe again
            log.warning("fleet follower lost Redis: %s", type(exc).__name__)
            await asyncio.sleep(1)
